//! `config.json` of an MLX/HF checkpoint: VLM `text_config` nesting, rope spellings, the quantization block.

use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{ModelError, Result};
use crate::quant::QuantConfig;

/// A parsed `config.json`: the text model's fields plus the (top-level) quantization block.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// Where it was read from (for error messages).
    pub path: PathBuf,
    /// The text model's own fields (`text_config` if nested, else the root), with rope keys normalised.
    pub text: Value,
    /// The `quantization` block, if any.
    pub quant: QuantConfig,
    /// `model_type` of the text model.
    pub model_type: String,
}

/// Each size field's most, far above any model's (the largest today: 16,384 wide, 128 heads of up to 512, a
/// 262k vocabulary, 512 experts, under 200 layers); a config saying more is corrupt. They are checked before
/// any architecture builds a table from them: a corrupt size would be an allocation too large to make, which
/// aborts the process instead of failing the load, or a product of sizes that overflows.
const SIZE_LIMITS: &[(&str, u64)] = &[
    ("num_hidden_layers", 1 << 16),
    ("hidden_size", 1 << 18),
    ("intermediate_size", 1 << 20),
    ("moe_intermediate_size", 1 << 20),
    ("shared_expert_intermediate_size", 1 << 20),
    ("num_attention_heads", 1 << 12),
    ("num_key_value_heads", 1 << 12),
    ("head_dim", 1 << 12),
    ("vocab_size", 1 << 22),
    ("num_experts", 1 << 16),
    ("num_local_experts", 1 << 16),
    ("num_experts_per_tok", 1 << 16),
    ("linear_num_key_heads", 1 << 12),
    ("linear_num_value_heads", 1 << 12),
    ("linear_key_head_dim", 1 << 12),
    ("linear_value_head_dim", 1 << 12),
    ("linear_conv_kernel_dim", 1 << 10),
];

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io {
            path: path.clone(),
            source,
        })?;
        Self::parse(&path, &text)
    }

    /// Parses config text; `path` is used in errors only.
    pub fn parse(path: &Path, text: &str) -> Result<Self> {
        let bad = |message: String| ModelError::Config {
            path: path.to_path_buf(),
            message,
        };
        let root: Value = serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let Value::Object(root_map) = &root else {
            return Err(bad("expected a JSON object".into()));
        };
        // VLM-style checkpoints keep the language model's fields in `text_config`; the quantization block
        // stays at the top level.
        let mut text = match root_map.get("text_config") {
            Some(Value::Object(t)) => {
                let mut t = t.clone();
                t.retain(|_, v| !v.is_null());
                for (k, v) in root_map {
                    if k != "text_config" && !t.contains_key(k) && !k.starts_with("quantization") {
                        t.insert(k.clone(), v.clone());
                    }
                }
                Value::Object(t)
            }
            _ => root.clone(),
        };
        // A field written as null is one left out (transformers' configs write `None` defaults so, e.g.
        // `"mlp_only_layers": null`), not a value of the wrong type.
        if let Value::Object(t) = &mut text {
            t.retain(|_, v| !v.is_null());
        }
        normalise_rope(&mut text);
        let model_type = text
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| root.get("model_type").and_then(Value::as_str))
            .ok_or_else(|| bad("missing `model_type`".into()))?
            .to_string();
        for &(field, most) in SIZE_LIMITS {
            if let Some(n) = text.get(field).and_then(Value::as_u64).filter(|&n| n > most) {
                return Err(bad(format!("{field} {n} is more than {most}")));
            }
        }
        // MLX writes its own block as `quantization` (and `quantization_config` beside it, the same, with no
        // method); a `quantization_config` alone naming a method is another tool's format (FP8, GPTQ, AWQ, …).
        // (Some tools name MLX's own block's method `mlx`.)
        let mlx_block = root.get("quantization").filter(|q| !q.is_null());
        let method = (root.get("quantization_config").and_then(|q| q.get("quant_method")))
            .filter(|m| !m.is_null() && !m.as_str().is_some_and(|m| m.eq_ignore_ascii_case("mlx")));
        if let (None, Some(method)) = (mlx_block, method) {
            let method = method.as_str().map_or_else(|| method.to_string(), String::from);
            return Err(bad(format!(
                "the weights are quantized with `{method}` (quantization_config.quant_method), which sluice does \
                 not read; use an MLX quantization of the model (`mlx_lm.convert -q`, or an mlx-community one) \
                 or its unquantized original"
            )));
        }
        let quant_block = mlx_block.or_else(|| root.get("quantization_config"));
        let quant = QuantConfig::parse(quant_block).map_err(bad)?;
        Ok(Self {
            path: path.to_path_buf(),
            text,
            quant,
            model_type,
        })
    }

    /// Deserializes the text fields into an architecture's config struct, naming the file on error.
    pub fn typed<T: DeserializeOwned>(&self) -> Result<T> {
        serde_json::from_value(self.text.clone()).map_err(|e| ModelError::Config {
            path: self.path.clone(),
            message: e.to_string(),
        })
    }

    /// Refuses a config without each of `fields` (those an architecture has no default for), or with one null.
    pub fn require(&self, fields: &[&str]) -> Result<()> {
        match fields.iter().find(|f| self.text.get(**f).is_none_or(Value::is_null)) {
            Some(field) => Err(self.error(format!("missing field `{field}`"))),
            None => Ok(()),
        }
    }

    /// A config error naming this file.
    pub fn error(&self, message: impl Into<String>) -> ModelError {
        ModelError::Config {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    /// `eos_token_id` as a list (it may be a single id or a list).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        token_ids(self.text.get("eos_token_id"))
    }
}

/// A token-id field that may be one id or a list of ids (`eos_token_id` in config and generation config).
pub fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        // An id past u32 is past every vocabulary: dropped, not truncated into some real token's id.
        Some(Value::Number(n)) => n.as_u64().and_then(|x| u32::try_from(x).ok()).into_iter().collect(),
        Some(Value::Array(a)) => (a.iter().filter_map(Value::as_u64))
            .filter_map(|x| u32::try_from(x).ok())
            .collect(),
        _ => Vec::new(),
    }
}

/// transformers ≥ 5 writes `rope_parameters: {rope_theta, rope_type, ...}` instead of `rope_theta` +
/// `rope_scaling`; fold it into the legacy keys so model configs read one spelling.
fn normalise_rope(text: &mut Value) {
    let Value::Object(map) = text else { return };
    let Some(Value::Object(params)) = map.get("rope_parameters").cloned() else {
        return;
    };
    if let (false, Some(theta)) = (map.contains_key("rope_theta"), params.get("rope_theta")) {
        map.insert("rope_theta".into(), theta.clone());
    }
    if let (false, Some(f)) = (
        map.contains_key("partial_rotary_factor"),
        params.get("partial_rotary_factor"),
    ) {
        map.insert("partial_rotary_factor".into(), f.clone());
    }
    let kind = params
        .get("type")
        .or_else(|| params.get("rope_type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    if kind != "default" && map.get("rope_scaling").is_none_or(|v| v.is_null()) {
        map.insert("rope_scaling".into(), Value::Object(params));
    }
}

/// Rope scaling as written in `rope_scaling` (HF field names).
#[derive(Debug, Clone, Default, serde::Deserialize)]
pub struct RopeScaling {
    /// "default", "linear", "yarn".
    pub rope_type: Option<String>,
    /// The same in older configs; transformers re-saving one keeps both keys.
    #[serde(rename = "type")]
    pub legacy_type: Option<String>,
    /// Scale factor.
    pub factor: Option<f64>,
    /// YaRN: context length the model was trained at.
    pub original_max_position_embeddings: Option<f64>,
    /// YaRN: fast boundary.
    pub beta_fast: Option<f64>,
    /// YaRN: slow boundary.
    pub beta_slow: Option<f64>,
    /// YaRN: magnitude scale numerator.
    pub mscale: Option<f64>,
    /// YaRN: magnitude scale denominator.
    pub mscale_all_dim: Option<f64>,
    /// YaRN: whether to floor/ceil the correction range (HF's `truncate`, default true).
    pub truncate: Option<bool>,
    /// YaRN: the attention scale itself, in place of the one computed from `mscale` (HF, mlx-lm).
    pub attention_factor: Option<f64>,
}

impl RopeScaling {
    /// The scaling kind: `type` first, as mlx-lm reads it, then `rope_type`, else "default".
    pub fn kind(&self) -> &str {
        (self.legacy_type.as_deref())
            .or(self.rope_type.as_deref())
            .unwrap_or("default")
    }
}

/// The context a model serves: `max_position_embeddings`, or what its rope scaling extends it to (linear:
/// `factor` × it; YaRN: `factor` × `original_max_position_embeddings`, as vLLM derives it, and without that
/// field no extension, since the rope's own default for it is mlx-lm's 4096); never less than
/// `max_position_embeddings`.
pub fn context_length(max_position_embeddings: usize, scaling: Option<&RopeScaling>) -> usize {
    let Some(s) = scaling else {
        return max_position_embeddings;
    };
    let factor = s.factor.filter(|f| f.is_finite() && *f > 1.0);
    let original = (s.original_max_position_embeddings).filter(|o| o.is_finite() && *o > 0.0);
    let scaled = match (s.kind(), factor, original) {
        ("linear", Some(f), _) => max_position_embeddings as f64 * f,
        ("yarn", Some(f), Some(o)) => o * f,
        _ => 0.0,
    };
    let scaled = scaled.min(u32::MAX as f64) as usize;
    max_position_embeddings.max(scaled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_text_config_and_rope_parameters() {
        let c = ModelConfig::parse(
            Path::new("c.json"),
            r#"{"model_type":"qwen3_vl_moe","text_config":{"model_type":"qwen3_moe","hidden_size":8,
                "rope_parameters":{"rope_type":"default","rope_theta":5000.0}},
                "eos_token_id":[1,2],"quantization":{"group_size":64,"bits":4}}"#,
        )
        .unwrap();
        assert_eq!(c.model_type, "qwen3_moe");
        assert_eq!(c.text["rope_theta"], 5000.0);
        assert!(c.text.get("rope_scaling").is_none());
        assert_eq!(c.eos_token_ids(), vec![1, 2]);
        assert_eq!(c.quant.default.unwrap().bits, 4);
        // Ids past u32 are dropped, not truncated (2^32 + 2 would have read as token 2).
        for (eos, want) in [("[1,4294967298]", vec![1]), ("4294967298", vec![])] {
            let c = ModelConfig::parse(
                Path::new("c.json"),
                &format!(r#"{{"model_type":"qwen3_moe","eos_token_id":{eos}}}"#),
            )
            .unwrap();
            assert_eq!(c.eos_token_ids(), want, "{eos}");
        }
    }

    #[test]
    fn rope_scaling_kinds_and_the_context_they_extend_to() {
        let scaling = |json: &str| -> RopeScaling { serde_json::from_str(json).unwrap() };
        // Both spellings at once, as transformers re-saves a legacy config: `type` wins, as in mlx-lm.
        let both =
            scaling(r#"{"type":"yarn","rope_type":"yarn","factor":4.0,"original_max_position_embeddings":32768}"#);
        assert_eq!(both.kind(), "yarn");
        assert_eq!(scaling(r#"{"rope_type":"linear","factor":2.0}"#).kind(), "linear");
        assert_eq!(scaling(r#"{"factor":2.0}"#).kind(), "default");
        // Qwen3's documented YaRN block on a 40,960-token config serves 4 × 32,768.
        assert_eq!(context_length(40960, Some(&both)), 131072);
        assert_eq!(context_length(40960, None), 40960);
        // On a 4,096-token config: linear doubles it; a factor that does not extend, a kind that does not scale
        // positions, and YaRN without its original context (the rope assumes mlx-lm's 4096 for it) leave it.
        for (block, want) in [
            (r#"{"type":"linear","factor":2.0}"#, 8192),
            (r#"{"type":"yarn","factor":0.5}"#, 4096),
            (r#"{"type":"mrope","factor":4.0}"#, 4096),
            (r#"{"type":"yarn","factor":4.0}"#, 4096),
        ] {
            assert_eq!(context_length(4096, Some(&scaling(block))), want, "{block}");
        }
        // Through a whole config: the block in `rope_parameters` too.
        let c = ModelConfig::parse(
            Path::new("c.json"),
            r#"{"model_type":"qwen3_moe","rope_parameters":{"rope_type":"yarn","type":"yarn","factor":4.0,
                "original_max_position_embeddings":32768,"rope_theta":1e6}}"#,
        )
        .unwrap();
        let s: RopeScaling = serde_json::from_value(c.text["rope_scaling"].clone()).unwrap();
        assert_eq!((s.kind(), context_length(40960, Some(&s))), ("yarn", 131072));
    }

    #[test]
    fn garbled_or_incomplete_config_names_the_file() {
        let e = ModelConfig::parse(Path::new("/m/config.json"), "{not json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("/m/config.json") && e.contains("not valid JSON"), "{e}");
        let e = ModelConfig::parse(Path::new("/m/config.json"), "{}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("model_type"), "{e}");
        let e = ModelConfig::parse(
            Path::new("/m/config.json"),
            r#"{"model_type":"qwen3_moe","num_hidden_layers":100000000000}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("num_hidden_layers 100000000000"), "{e}");
    }

    #[test]
    fn another_tools_quantization_is_named() {
        let parse = |json: &str| ModelConfig::parse(Path::new("/m/config.json"), json);
        let fp8 = r#"{"model_type":"qwen3_moe","quantization_config":{"quant_method":"fp8","fmt":"e4m3",
            "weight_block_size":[128,128]}}"#;
        let e = parse(fp8).unwrap_err().to_string();
        assert!(e.contains("`fp8`") && e.contains("mlx_lm.convert"), "{e}");
        let gptq =
            r#"{"model_type":"qwen3_moe","quantization_config":{"quant_method":"gptq","bits":4,"group_size":-1}}"#;
        assert!(parse(gptq).unwrap_err().to_string().contains("`gptq`"));
        // MLX's own: `quantization`, and `quantization_config` beside it (or alone) without a method.
        let mlx = r#"{"model_type":"qwen3_moe","quantization":{"group_size":64,"bits":4},
            "quantization_config":{"group_size":64,"bits":4}}"#;
        assert!(parse(mlx).unwrap().quant.default.is_some());
        let alone = r#"{"model_type":"qwen3_moe","quantization_config":{"group_size":32,"bits":8}}"#;
        assert!(parse(alone).unwrap().quant.default.is_some());
        let named =
            r#"{"model_type":"qwen3_moe","quantization_config":{"quant_method":"MLX","group_size":32,"bits":8}}"#;
        assert!(parse(named).unwrap().quant.default.is_some());
        // A null `quantization` is one left out.
        let null = r#"{"model_type":"qwen3_moe","quantization":null,"quantization_config":{"group_size":32,"bits":8}}"#;
        assert!(parse(null).unwrap().quant.default.is_some());
    }

    #[test]
    fn a_null_field_is_a_field_left_out() {
        let c = ModelConfig::parse(
            Path::new("/m/config.json"),
            r#"{"model_type":"qwen3_moe","mlp_only_layers":null,"text_config":{"head_dim":null},"head_dim":64}"#,
        )
        .unwrap();
        assert!(c.text.get("mlp_only_layers").is_none());
        // A null in text_config is filled from the top level, as a missing field is.
        assert_eq!(c.text["head_dim"], 64);
    }

    #[test]
    fn a_size_past_any_model_is_refused_before_anything_is_built_from_it() {
        for &(field, most) in SIZE_LIMITS {
            for nested in [false, true] {
                let fields = format!(r#""model_type":"qwen3_moe","{field}":{}"#, most + 1);
                let text = if nested {
                    format!(r#"{{"model_type":"qwen3_vl_moe","text_config":{{{fields}}}}}"#)
                } else {
                    format!("{{{fields}}}")
                };
                let e = ModelConfig::parse(Path::new("/m/config.json"), &text)
                    .unwrap_err()
                    .to_string();
                assert!(e.contains(&format!("{field} {}", most + 1)), "{e}");
                let at_most = text.replace(&(most + 1).to_string(), &most.to_string());
                assert!(
                    ModelConfig::parse(Path::new("/m/config.json"), &at_most).is_ok(),
                    "{field}"
                );
            }
        }
    }
}
