//! `tokenizer.json` and `tokenizer_config.json` rebuilt from a GGUF's `tokenizer.ggml.*` metadata,
//! the way transformers' GGUF import builds them (`gguf_tokenizer_mapping.py`): byte-level BPE for
//! the `gpt2` model, byte-fallback BPE with merges from the file or recovered from the vocabulary
//! for the `llama` (SentencePiece) model, with Gemma's respelling and merge order.
use std::collections::{HashMap, HashSet};

use serde_json::{json, Value};

use super::{GgufError, GgufHeader, MetaValue};

/// llama.cpp token types.
const TOKEN_UNKNOWN: i64 = 2;
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

/// The files a tokenizer rebuild produces.
#[derive(Debug, Clone)]
pub struct HfTokenizer {
    pub tokenizer_json: Value,
    pub tokenizer_config: Value,
    pub bos_token_id: Option<u64>,
    pub eos_token_id: Option<u64>,
    pub pad_token_id: Option<u64>,
    pub vocab_size: usize,
    /// Where `chat_template` came from (`None`: the GGUF has none and no built-in applies).
    pub chat_template: Option<ChatTemplateSource>,
}

/// The origin of a rebuilt `chat_template`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChatTemplateSource {
    /// `tokenizer.chat_template` of the GGUF.
    Gguf,
    /// The GGUF has none; the architecture's turn format ([`GEMMA_TURN_TEMPLATE`] for Gemma),
    /// as llama.cpp falls back to its built-in template of the architecture.
    Builtin,
}

/// Gemma's turn format (`<start_of_turn>{user|model}\n...<end_of_turn>\n`, a system message
/// folded into the first user turn, `model` for the assistant), for Gemma GGUFs without a
/// template.
pub const GEMMA_TURN_TEMPLATE: &str = concat!(
    "{{ bos_token }}",
    "{%- if messages[0]['role'] == 'system' -%}",
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}",
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}",
    "{%- for message in loop_messages -%}",
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}",
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}",
);

/// GPT-2's `bytes_to_unicode`: the printable stand-in for each byte.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut bs: Vec<u32> = (u32::from('!')..=u32::from('~')).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    let mut out = ['\0'; 256];
    for (b, c) in bs.into_iter().zip(cs) {
        out[b as usize] = char::from_u32(c).expect("valid code point");
    }
    out
}

/// Pre-tokenizer split patterns by `tokenizer.ggml.pre`, as transformers maps them.
fn split_regex(pre: &str) -> Option<&'static str> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" | "jina-v5-nano"
        | "dbrx" | "smaug-bpe" => LLAMA3,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2,
        "tekken" => TEKKEN,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O,
        _ => return None,
    })
}

fn tok_err(msg: impl Into<String>) -> GgufError {
    GgufError::Data(format!("tokenizer metadata: {}", msg.into()))
}

fn strings<'a>(h: &'a GgufHeader, key: &str) -> Result<Vec<&'a str>, GgufError> {
    h.get_array(key)?
        .iter()
        .map(|v| v.as_str().ok_or_else(|| GgufError::MetadataType { key: key.into(), expected: "an array of strings", found: v.type_name() }))
        .collect()
}

fn opt_u64(h: &GgufHeader, key: &str) -> Result<Option<u64>, GgufError> {
    h.get(key).map(|_| h.get_u64(key)).transpose()
}

fn opt_bool(h: &GgufHeader, key: &str) -> Result<Option<bool>, GgufError> {
    match h.get(key) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| GgufError::MetadataType { key: key.into(), expected: "a bool", found: v.type_name() }),
    }
}

/// A vocabulary as a Python dict built from an enumerated list: first-occurrence order, the last
/// occurrence's id.
/// `tokenizer.ggml.merges` entries (`"a b"`) as pairs.
fn merge_pairs(merges: &[&str]) -> Result<Vec<(String, String)>, GgufError> {
    merges
        .iter()
        .map(|m| {
            let mut it = m.split(' ');
            match (it.next(), it.next(), it.next()) {
                (Some(a), Some(b), None) => Ok((a.to_string(), b.to_string())),
                _ => Err(tok_err(format!("merge {m:?} is not two space-separated pieces"))),
            }
        })
        .collect()
}

fn vocab_dict(tokens: &[String]) -> (Vec<String>, HashMap<String, usize>) {
    let mut order = Vec::with_capacity(tokens.len());
    let mut ids = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        if ids.insert(t.clone(), i).is_none() {
            order.push(t.clone());
        }
    }
    (order, ids)
}

/// transformers' `generate_merges(vocab, vocab_scores)`: every split of every token into two
/// vocabulary pieces, ordered by score (highest first), then by piece lengths.
fn generate_merges(order: &[String], vocab: &HashMap<String, usize>, scores: &HashMap<String, f64>) -> Vec<(String, String)> {
    let mut merges: Vec<(String, String, f64, usize, usize)> = Vec::new();
    for merge in order {
        let score = scores[merge];
        let cuts: Vec<usize> = merge.char_indices().map(|(i, _)| i).skip(1).collect();
        let mut local = Vec::new();
        for &i in &cuts {
            let (l, r) = merge.split_at(i);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                local.push((l.to_string(), r.to_string(), score, li, ri));
            }
        }
        local.sort_by_key(|x| (x.3, x.4));
        merges.extend(local);
    }
    let key = |m: &(String, String, f64, usize, usize)| (m.2, m.0.chars().count(), m.1.chars().count());
    // Python's sorted(reverse=True) is stable: equal keys keep their order.
    merges.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        kb.0.total_cmp(&ka.0).then(kb.1.cmp(&ka.1)).then(kb.2.cmp(&ka.2))
    });
    merges.into_iter().map(|m| (m.0, m.1)).collect()
}

fn added_token(id: usize, content: &str, special: bool) -> Value {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": special})
}

fn template_processor(bos: Option<(&str, usize)>, eos: Option<(&str, usize)>) -> Value {
    let mut single = Vec::new();
    let mut pair = Vec::new();
    let mut specials = serde_json::Map::new();
    if let Some((t, id)) = bos {
        single.push(json!({"SpecialToken": {"id": t, "type_id": 0}}));
        pair.push(json!({"SpecialToken": {"id": t, "type_id": 0}}));
        specials.insert(t.into(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    single.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    pair.push(json!({"Sequence": {"id": "A", "type_id": 0}}));
    if let Some((t, id)) = eos {
        single.push(json!({"SpecialToken": {"id": t, "type_id": 0}}));
        pair.push(json!({"SpecialToken": {"id": t, "type_id": 0}}));
        specials.insert(t.into(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    if let Some((t, _)) = bos {
        pair.push(json!({"SpecialToken": {"id": t, "type_id": 1}}));
    }
    pair.push(json!({"Sequence": {"id": "B", "type_id": 1}}));
    if let Some((t, _)) = eos {
        pair.push(json!({"SpecialToken": {"id": t, "type_id": 1}}));
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials})
}

/// Rebuild the tokenizer a GGUF describes.
pub fn build(h: &GgufHeader) -> Result<HfTokenizer, GgufError> {
    let arch = h.architecture()?;
    let model = h.get_str("tokenizer.ggml.model")?;
    let raw_tokens = strings(h, "tokenizer.ggml.tokens")?;
    let n = raw_tokens.len();
    let types: Vec<i64> = match h.get("tokenizer.ggml.token_type") {
        None => vec![1; n],
        Some(_) => h
            .get_array("tokenizer.ggml.token_type")?
            .iter()
            .map(|v| v.as_i64().ok_or_else(|| tok_err("token_type holds a non-integer")))
            .collect::<Result<_, _>>()?,
    };
    if types.len() != n {
        return Err(tok_err(format!("{} token types for {n} tokens", types.len())));
    }
    let merges_meta = match h.get("tokenizer.ggml.merges") {
        None => None,
        Some(_) => Some(strings(h, "tokenizer.ggml.merges")?),
    };
    let id_of = |key: &str| -> Result<Option<u64>, GgufError> {
        let id = opt_u64(h, key)?;
        if let Some(i) = id {
            if i as usize >= n {
                return Err(tok_err(format!("{key} = {i} is outside the {n}-token vocabulary")));
            }
        }
        Ok(id)
    };
    let bos = id_of("tokenizer.ggml.bos_token_id")?;
    let eos = id_of("tokenizer.ggml.eos_token_id")?;
    let unk = id_of("tokenizer.ggml.unknown_token_id")?;
    let pad = id_of("tokenizer.ggml.padding_token_id")?;
    let add_bos = match opt_bool(h, "tokenizer.ggml.add_bos_token")? {
        Some(b) => b,
        None => model == "llama",
    };
    let add_eos = opt_bool(h, "tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let add_prefix_space = opt_bool(h, "tokenizer.ggml.add_space_prefix")?.unwrap_or(true);

    let (tokens, merges, model_json, normalizer, pre_tokenizer, decoder, byte_level) = match model {
        "gpt2" => {
            let spelling = bytes_to_unicode();
            let alphabet: HashSet<char> = spelling.iter().copied().collect();
            let tokens: Vec<String> = raw_tokens
                .iter()
                .map(|t| {
                    if t.chars().all(|c| alphabet.contains(&c)) {
                        t.to_string()
                    } else {
                        t.bytes().map(|b| spelling[b as usize]).collect()
                    }
                })
                .collect();
            let merges = merges_meta.ok_or_else(|| tok_err("a gpt2 tokenizer without tokenizer.ggml.merges"))?;
            let merges = merge_pairs(&merges)?;
            let pre = match h.get("tokenizer.ggml.pre").and_then(MetaValue::as_str).and_then(split_regex) {
                Some(re) => json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
                ]}),
                None => json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}),
            };
            let model = json!({"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
                "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false, "ignore_merges": false});
            let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
            (tokens, merges, model, Value::Null, pre, decoder, true)
        }
        "llama" => {
            let gemma = matches!(arch, "gemma" | "gemma2" | "gemma3");
            let tokens: Vec<String> = raw_tokens
                .iter()
                .map(|t| if gemma && t.contains(' ') && t.trim().is_empty() { "\u{2581}".repeat(t.chars().count()) } else { t.to_string() })
                .collect();
            let (order, vocab) = vocab_dict(&tokens);
            let merges = match merges_meta {
                Some(m) => merge_pairs(&m)?,
                None => {
                    let mut scores = HashMap::with_capacity(order.len());
                    if gemma {
                        for (i, t) in tokens.iter().enumerate() {
                            scores.insert(t.clone(), -(i as f64));
                        }
                    } else {
                        let s = h.get_array("tokenizer.ggml.scores")?;
                        if s.len() != n {
                            return Err(tok_err(format!("{} scores for {n} tokens", s.len())));
                        }
                        for (t, v) in tokens.iter().zip(s) {
                            let v = v.as_f64().ok_or_else(|| tok_err("scores holds a non-number"))?;
                            scores.insert(t.clone(), v);
                        }
                    }
                    generate_merges(&order, &vocab, &scores)
                }
            };
            let unk_token = unk.map(|i| tokens[i as usize].clone());
            let model = json!({"type": "BPE", "dropout": null, "unk_token": unk_token, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false});
            let (normalizer, pre, decoder) = if gemma {
                (
                    json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
                    json!({"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": false}),
                    json!({"type": "Sequence", "decoders": [
                        {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                        {"type": "ByteFallback"}, {"type": "Fuse"}]}),
                )
            } else {
                let scheme = if add_prefix_space { "first" } else { "never" };
                let mut decoders = vec![
                    json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                    json!({"type": "ByteFallback"}),
                    json!({"type": "Fuse"}),
                ];
                if add_prefix_space {
                    decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                }
                (
                    Value::Null,
                    json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": scheme, "split": false}),
                    json!({"type": "Sequence", "decoders": decoders}),
                )
            };
            (tokens, merges, model, normalizer, pre, decoder, false)
        }
        other => {
            return Err(tok_err(format!("tokenizer model {other:?} is not supported (gpt2 and llama are)")));
        }
    };

    let (_, vocab) = vocab_dict(&tokens);
    let spelled: HashSet<char> = bytes_to_unicode().into_iter().collect();
    let mut added = Vec::new();
    for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
        let control = ty == TOKEN_CONTROL && (!byte_level || t.chars().all(|c| spelled.contains(&c)));
        let unknown = ty == TOKEN_UNKNOWN && !byte_level;
        if control || unknown {
            added.push(added_token(i, t, true));
        } else if ty == TOKEN_USER_DEFINED && vocab.get(t) == Some(&i) {
            added.push(added_token(i, t, false));
        }
    }
    let mut model_json = model_json;
    let vocab_json: serde_json::Map<String, Value> = {
        let (order, ids) = vocab_dict(&tokens);
        order.into_iter().map(|t| {
            let id = ids[&t];
            (t, json!(id))
        }).collect()
    };
    model_json["vocab"] = Value::Object(vocab_json);
    model_json["merges"] = Value::Array(merges.into_iter().map(|(a, b)| json!([a, b])).collect());
    let token = |id: Option<u64>| id.map(|i| tokens[i as usize].as_str());
    let post = template_processor(
        if add_bos { bos.map(|i| (tokens[i as usize].as_str(), i as usize)) } else { None },
        if add_eos { eos.map(|i| (tokens[i as usize].as_str(), i as usize)) } else { None },
    );
    let tokenizer_json = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post,
        "decoder": decoder,
        "model": model_json,
    });
    let mut cfg = serde_json::Map::new();
    cfg.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    cfg.insert("add_bos_token".into(), json!(add_bos));
    cfg.insert("add_eos_token".into(), json!(add_eos));
    for (name, id) in [("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad)] {
        cfg.insert(name.into(), token(id).map_or(Value::Null, |t| json!(t)));
    }
    if let Some(len) = h.get(&format!("{arch}.context_length")).and_then(MetaValue::as_u64) {
        cfg.insert("model_max_length".into(), json!(len));
    }
    let chat_template = if let Some(t) = h.get("tokenizer.chat_template") {
        let t = t.as_str().ok_or_else(|| GgufError::MetadataType { key: "tokenizer.chat_template".into(), expected: "a string", found: t.type_name() })?;
        cfg.insert("chat_template".into(), json!(t));
        Some(ChatTemplateSource::Gguf)
    } else if arch.starts_with("gemma") && tokens.iter().any(|t| t == "<start_of_turn>") {
        cfg.insert("chat_template".into(), json!(GEMMA_TURN_TEMPLATE));
        Some(ChatTemplateSource::Builtin)
    } else {
        None
    };
    Ok(HfTokenizer {
        tokenizer_json,
        tokenizer_config: Value::Object(cfg),
        bos_token_id: bos,
        eos_token_id: eos,
        pad_token_id: pad,
        vocab_size: n,
        chat_template,
    })
}
