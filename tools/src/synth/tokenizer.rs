//! A word-piece tokenizer of any vocabulary size and a ChatML template, so synthesized models can be
//! prompted, chatted with and served.

use serde_json::{json, Value};

pub(super) const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
/// `<|im_end|>`: the end of an assistant turn.
pub(super) const EOS_ID: usize = 2;

/// The `k`-th generated word: bijective base-80 over consonant-vowel syllables ("ba", "be", …, "zu", "baba", …).
pub(super) fn word(k: usize) -> String {
    const C: &[u8] = b"bdfghjklmnprstvz";
    const V: &[u8] = b"aeiou";
    let mut n = k + 1;
    let mut w = String::new();
    while n > 0 {
        n -= 1;
        let d = n % (C.len() * V.len());
        w.push(C[d / V.len()] as char);
        w.push(V[d % V.len()] as char);
        n /= C.len() * V.len();
    }
    w
}

/// tokenizer.json and tokenizer_config.json: a WordPiece tokenizer with exactly `vocab` ids (three ChatML
/// special tokens, every printable ASCII character as a word start and as a `##` continuation, then generated
/// words), so ASCII text encodes without unknowns and every id decodes to text; and a ChatML template.
pub(super) fn tokenizer_files(vocab: usize) -> (String, String) {
    let chars = (33u8..=126).map(|c| (c as char).to_string());
    let pieces = SPECIALS
        .iter()
        .map(|s| s.to_string())
        .chain(chars.clone())
        .chain(chars.map(|c| format!("##{c}")))
        .chain((0..).map(word));
    let map: serde_json::Map<String, Value> = pieces.take(vocab).enumerate().map(|(i, p)| (p, json!(i))).collect();
    let added: Vec<_> = (SPECIALS.iter().enumerate())
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                   "normalized": false, "special": true})
        })
        .collect();
    let tok = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": false},
        "model": {
            "type": "WordPiece",
            "unk_token": SPECIALS[0],
            "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": map,
        },
    });
    let template = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] \
                    + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}\
                    {% endif %}";
    let cfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": SPECIALS[EOS_ID],
        "pad_token": SPECIALS[0],
        "unk_token": SPECIALS[0],
        "model_max_length": 131072,
        "chat_template": template,
    });
    (
        tok.to_string(),
        serde_json::to_string_pretty(&cfg).expect("a JSON value serializes"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_distinct() {
        let words: std::collections::HashSet<String> = (0..200_000).map(word).collect();
        assert_eq!(words.len(), 200_000);
        assert_eq!(word(0), "ba");
    }
}
