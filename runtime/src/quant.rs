//! The `quantization` block of an MLX config: defaults plus per-module overrides.

use std::collections::HashMap;

use serde_json::Value;

/// How one module's weight is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    /// Bits per code.
    pub bits: u32,
    /// Columns per scale/bias group.
    pub group_size: usize,
    /// Quantization mode.
    pub mode: QuantMode,
}

impl QuantSpec {
    /// Whether the kernels take codes of this width in groups of this size (2–6 or 8 bits, whole 32-bit words
    /// per group); the error says what is not.
    pub fn check_widths(&self) -> Result<(), String> {
        let (bits, group) = (self.bits, self.group_size);
        if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8)
            || group == 0
            || group.checked_mul(bits as usize).is_none_or(|b| !b.is_multiple_of(32))
        {
            return Err(format!("{bits}-bit codes in groups of {group} are not supported"));
        }
        Ok(())
    }
}

/// Quantization modes MLX writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMode {
    /// `w = scale·q + bias` (the default; the only mode the kernels implement so far).
    Affine,
    /// E2M1 codes with E8M0 scales, no biases.
    Mxfp4,
    /// E2M1 codes with E4M3 scales.
    Nvfp4,
    /// E4M3 codes with E8M0 scales.
    Mxfp8,
}

impl QuantMode {
    fn parse(s: &str) -> Result<Self, String> {
        match s {
            "affine" => Ok(Self::Affine),
            "mxfp4" => Ok(Self::Mxfp4),
            "nvfp4" => Ok(Self::Nvfp4),
            "mxfp8" => Ok(Self::Mxfp8),
            other => Err(format!("unknown quantization mode `{other}`")),
        }
    }

    /// MLX's default group size for the mode (used when a config gives `group_size: null`).
    fn default_group(self) -> usize {
        match self {
            Self::Affine => 64,
            Self::Mxfp4 | Self::Mxfp8 => 32,
            Self::Nvfp4 => 16,
        }
    }
}

/// One override entry: explicit parameters, or `false` for "not quantized".
#[derive(Debug, Clone, PartialEq, Eq)]
enum Override {
    Off,
    Spec(QuantSpec),
}

/// The parsed block. A module is quantized iff its `.scales` tensor exists (mlx-lm's rule); this says with
/// which parameters.
#[derive(Debug, Clone, Default)]
pub struct QuantConfig {
    /// Top-level defaults (`None` for an unquantized model).
    pub default: Option<QuantSpec>,
    overrides: HashMap<String, Override>,
}

impl QuantConfig {
    /// Parses the block (or its absence).
    pub fn parse(block: Option<&Value>) -> Result<Self, String> {
        let Some(block) = block.filter(|b| !b.is_null()) else {
            return Ok(Self::default());
        };
        let Value::Object(map) = block else {
            return Err("`quantization` must be an object".into());
        };
        let default_mode = match map.get("mode") {
            Some(Value::String(s)) => QuantMode::parse(s)?,
            None | Some(Value::Null) => QuantMode::Affine,
            Some(v) => return Err(format!("`quantization.mode` must be a string, got {v}")),
        };
        let base = spec_from(map, default_mode, "quantization")?;
        let mut overrides = HashMap::new();
        for (k, v) in map {
            if matches!(k.as_str(), "group_size" | "bits" | "mode" | "quant_method") {
                continue;
            }
            let o = match v {
                Value::Bool(false) => Override::Off,
                Value::Bool(true) => Override::Spec(base),
                // An override without `mode` does not inherit the top-level mode: MLX passes the dict to
                // `to_quantized`, whose default is affine.
                Value::Object(m) => {
                    let mode = match m.get("mode") {
                        Some(Value::String(s)) => QuantMode::parse(s)?,
                        _ => QuantMode::Affine,
                    };
                    Override::Spec(spec_from(m, mode, k)?)
                }
                _ => continue, // other metadata some tools add (e.g. strings); not a module override
            };
            overrides.insert(k.clone(), o);
        }
        Ok(Self {
            default: Some(base),
            overrides,
        })
    }

    /// Parameters for module `path` (without `.weight`), or `None` if the config says it is unquantized.
    /// `alt` is the same path as written with a checkpoint prefix (e.g. `language_model.`), tried too.
    pub fn spec_for(&self, path: &str, alt: Option<&str>) -> Option<QuantSpec> {
        let o = self
            .overrides
            .get(path)
            .or_else(|| alt.and_then(|a| self.overrides.get(a)));
        match o {
            Some(Override::Off) => None,
            Some(Override::Spec(s)) => Some(*s),
            None => self.default,
        }
    }
}

fn spec_from(m: &serde_json::Map<String, Value>, mode: QuantMode, at: &str) -> Result<QuantSpec, String> {
    let bits = match m.get("bits") {
        Some(v) => v
            .as_u64()
            .and_then(|b| u32::try_from(b).ok())
            .ok_or_else(|| format!("`{at}.bits` must be a non-negative integer below 2^32, got {v}"))?,
        None => match mode {
            QuantMode::Mxfp8 => 8,
            _ => 4,
        },
    };
    let group_size = match m.get("group_size") {
        None | Some(Value::Null) => mode.default_group(),
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("`{at}.group_size` must be an integer, got {v}"))? as usize,
    };
    Ok(QuantSpec { bits, group_size, mode })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_false_null_group_and_mode_not_inherited() {
        let v: Value = serde_json::from_str(
            r#"{"group_size":32,"bits":4,"mode":"mxfp4",
                "a.gate":{"group_size":64,"bits":8},
                "a.o_proj":false,
                "a.router":{"group_size":null,"bits":8},
                "language_model.b":{"bits":6,"group_size":128}}"#,
        )
        .unwrap();
        let q = QuantConfig::parse(Some(&v)).unwrap();
        assert_eq!(
            q.default,
            Some(QuantSpec {
                bits: 4,
                group_size: 32,
                mode: QuantMode::Mxfp4
            })
        );
        assert_eq!(
            q.spec_for("a.gate", None),
            Some(QuantSpec {
                bits: 8,
                group_size: 64,
                mode: QuantMode::Affine
            })
        );
        assert_eq!(q.spec_for("a.o_proj", None), None);
        assert_eq!(q.spec_for("a.router", None).unwrap().group_size, 64);
        assert_eq!(q.spec_for("b", Some("language_model.b")).unwrap().bits, 6);
        assert_eq!(q.spec_for("other", None), q.default);
    }

    #[test]
    fn bad_mode_is_an_error() {
        let v: Value = serde_json::from_str(r#"{"group_size":64,"bits":4,"mode":"q4_k"}"#).unwrap();
        assert!(QuantConfig::parse(Some(&v)).unwrap_err().contains("q4_k"));
        assert!(QuantConfig::parse(None).unwrap().default.is_none());
        // 2^32 + 4 bits is refused, not read as 4.
        let v: Value = serde_json::from_str(r#"{"group_size":64,"bits":4294967300}"#).unwrap();
        assert!(QuantConfig::parse(Some(&v)).unwrap_err().contains("bits"));
    }
}
