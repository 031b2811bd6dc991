//! `tokenizer.json` through the `tokenizers` crate, with the special tokens of the checkpoint
//! (tokenizer_config.json, generation_config.json, config.json) and an incremental decoder.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value as Json;

use super::error::{ChatError, Result};

/// The special tokens of a checkpoint, as strings (for the chat template) and ids (for decoding).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecialTokens {
    /// `bos_token` of tokenizer_config.json (None when null or absent).
    pub bos_token: Option<String>,
    pub bos_token_id: Option<u32>,
    /// `eos_token` of tokenizer_config.json.
    pub eos_token: Option<String>,
    /// Every id that ends generation: generation_config.json `eos_token_id` (int or list), then
    /// config.json `eos_token_id` (also under `text_config`), then the id of `eos_token`.
    /// Deduplicated, in that order.
    pub eos_token_ids: Vec<u32>,
    pub pad_token: Option<String>,
    pub pad_token_id: Option<u32>,
    pub unk_token: Option<String>,
    /// tokenizer_config.json `add_bos_token` (false when absent).
    pub add_bos_token: bool,
    /// Other named special tokens of tokenizer_config.json (`boi_token`, `image_token`, ...), which
    /// HF also hands to the chat template.
    pub extra: BTreeMap<String, String>,
}

/// A loaded tokenizer. Cheap to share between threads (`Send + Sync`).
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
    /// tokenizer_config.json as read (the chat template lives there too).
    config: Json,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .finish()
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Option<Json>> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s).map(Some).map_err(|e| ChatError::malformed(path, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ChatError::io(path, e)),
    }
}

/// A token in tokenizer_config.json is either a string or an AddedToken dict `{"content": ...}`.
fn token_string(v: Option<&Json>) -> Option<String> {
    match v? {
        Json::String(s) => Some(s.clone()),
        Json::Object(m) => m.get("content").and_then(Json::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `eos_token_id` may be an int, a list of ints, or null.
fn id_list(v: Option<&Json>, path: &Path, key: &str) -> Result<Vec<u32>> {
    let as_id = |x: &Json| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| ChatError::malformed(path, format!("\"{key}\" must be a token id or a list of token ids, got {x}")))
    };
    match v {
        None | Some(Json::Null) => Ok(vec![]),
        Some(Json::Array(a)) => a.iter().map(as_id).collect(),
        Some(x) => Ok(vec![as_id(x)?]),
    }
}

impl Tokenizer {
    /// Load `tokenizer.json` and the special-token side files from a checkpoint directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tok_path = dir.join("tokenizer.json");
        if !tok_path.is_file() {
            return Err(ChatError::TokenizerNotFound(dir.to_path_buf()));
        }
        let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Json::Object(Default::default()));
        let generation = read_json(&dir.join("generation_config.json"))?;
        let model_config = read_json(&dir.join("config.json"))?;
        let inner = load_tokenizer_file(&tok_path)?;
        Self::assemble(inner, config, generation.as_ref(), model_config.as_ref(), dir)
    }

    /// Build from an already loaded `tokenizers::Tokenizer` and the parsed side files (any may be
    /// absent). `origin` names the source in error messages.
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        tokenizer_config: Option<Json>,
        generation_config: Option<&Json>,
        model_config: Option<&Json>,
    ) -> Result<Self> {
        let config = tokenizer_config.unwrap_or(Json::Object(Default::default()));
        Self::assemble(inner, config, generation_config, model_config, Path::new("<memory>"))
    }

    fn assemble(
        inner: tokenizers::Tokenizer,
        config: Json,
        generation: Option<&Json>,
        model_config: Option<&Json>,
        dir: &Path,
    ) -> Result<Self> {
        let cfg_path = dir.join("tokenizer_config.json");
        if !config.is_object() {
            return Err(ChatError::malformed(&cfg_path, "expected a JSON object"));
        }
        let get = |k: &str| config.get(k);
        let bos_token = token_string(get("bos_token"));
        let eos_token = token_string(get("eos_token"));
        let pad_token = token_string(get("pad_token"));
        let unk_token = token_string(get("unk_token"));
        let id_of = |t: &Option<String>| t.as_deref().and_then(|t| inner.token_to_id(t));

        let mut eos_ids: Vec<u32> = Vec::new();
        let mut push = |ids: Vec<u32>| {
            for id in ids {
                if !eos_ids.contains(&id) {
                    eos_ids.push(id);
                }
            }
        };
        if let Some(g) = generation {
            push(id_list(g.get("eos_token_id"), &dir.join("generation_config.json"), "eos_token_id")?);
        }
        if let Some(c) = model_config {
            let p = dir.join("config.json");
            push(id_list(c.get("eos_token_id"), &p, "eos_token_id")?);
            if let Some(t) = c.get("text_config") {
                push(id_list(t.get("eos_token_id"), &p, "text_config.eos_token_id")?);
            }
        }
        push(id_of(&eos_token).into_iter().collect());

        let mut bos_token_id = id_of(&bos_token);
        if bos_token.is_none() {
            // tokenizer_config says null: keep the id from generation_config only for reporting,
            // the template gets no bos string.
            bos_token_id = None;
        }
        let mut extra = BTreeMap::new();
        if let Some(obj) = config.as_object() {
            for (k, v) in obj {
                if k.ends_with("_token") && !matches!(k.as_str(), "bos_token" | "eos_token" | "pad_token" | "unk_token") {
                    if let Some(s) = token_string(Some(v)) {
                        extra.insert(k.clone(), s);
                    }
                }
            }
        }
        let special = SpecialTokens {
            bos_token_id,
            pad_token_id: id_of(&pad_token),
            bos_token,
            eos_token,
            eos_token_ids: eos_ids,
            pad_token,
            unk_token,
            add_bos_token: get("add_bos_token").and_then(Json::as_bool).unwrap_or(false),
            extra,
        };
        Ok(Tokenizer { inner, special, config })
    }

    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// The parsed tokenizer_config.json (an empty object when the file is absent).
    pub fn tokenizer_config(&self) -> &Json {
        &self.config
    }

    /// The ids that end generation (see [`SpecialTokens::eos_token_ids`]).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.special.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.special.bos_token_id
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is an added token flagged special (removed by `skip_special_tokens`).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }

    /// The underlying `tokenizers` object.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encode text. `add_special_tokens` runs the post-processor (e.g. Gemma's `<bos>`); chat
    /// prompts are encoded without it because the template writes the special tokens itself.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode_fast(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| ChatError::Encode(e.to_string()))
    }

    /// Decode ids to text. Ids outside the vocabulary are skipped (as in HF).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| ChatError::Decode(e.to_string()))
    }

    /// An incremental decoder for generated ids.
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }
}

fn load_tokenizer_file(path: &PathBuf) -> Result<tokenizers::Tokenizer> {
    let bytes = std::fs::read(path).map_err(|e| ChatError::io(path, e))?;
    tokenizers::Tokenizer::from_bytes(&bytes)
        .map_err(|e| ChatError::TokenizerLoad { path: path.clone(), reason: e.to_string() })
}

/// Turns generated token ids into text deltas without splitting a UTF-8 character.
///
/// Byte-level BPE and byte-fallback tokenizers emit characters one byte at a time; decoding such
/// a partial sequence gives U+FFFD. The decoder keeps a window of ids, decodes it, and only emits
/// the new text once it no longer ends in a replacement character (the same scheme as HF's
/// `DecodeStream`). Decoding the window from a token boundary also keeps decoders that strip a
/// leading space (SentencePiece) right. [`StreamDecoder::finish`] flushes what is still held back.
///
/// The concatenation of all deltas plus `finish()` equals `decode(all ids)` whenever the
/// decoder's output is the concatenation of per-token pieces (true for ByteLevel and
/// ByteFallback/Fuse decoders).
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Text of `ids[prefix_offset..read_offset]`.
    prefix_text: String,
}

/// Ids a partial character may keep pending before they are flushed anyway (a UTF-8 character is
/// at most 4 bytes; anything longer is junk bytes the model emitted).
const MAX_PENDING_IDS: usize = 8;

impl<'a> StreamDecoder<'a> {
    pub fn new(tok: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        StreamDecoder { tok, skip_special: skip_special_tokens, ids: Vec::new(), prefix_offset: 0, read_offset: 0, prefix_text: String::new() }
    }

    /// Feed one id; returns the text it completes, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        let pending = self.ids.len() - self.read_offset;
        if text.len() > self.prefix_text.len()
            && text.is_char_boundary(self.prefix_text.len())
            && (!text.ends_with('\u{FFFD}') || pending >= MAX_PENDING_IDS)
        {
            let delta = text[self.prefix_text.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            self.prefix_text = self.tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special)?;
            Ok(Some(delta))
        } else {
            Ok(None)
        }
    }

    /// Feed several ids; returns the concatenated text they complete (possibly empty).
    pub fn step_many(&mut self, ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        for &id in ids {
            if let Some(d) = self.step(id)? {
                out.push_str(&d);
            }
        }
        Ok(out)
    }

    /// Flush the held-back text (an incomplete character decodes as U+FFFD, as in a full decode).
    pub fn finish(&mut self) -> Result<String> {
        let text = self.tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        let out = if text.len() >= self.prefix_text.len() && text.is_char_boundary(self.prefix_text.len()) {
            text[self.prefix_text.len()..].to_owned()
        } else {
            String::new()
        };
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        self.prefix_text.clear();
        Ok(out)
    }

    /// All ids fed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
