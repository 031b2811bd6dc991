//! Reading the text of an image with a vision-language model (what the `ocr` example runs): a
//! fresh conversation of one user message carrying the image and an instruction, decoded
//! greedily.
//!
//! The message goes through a [`ChatSession`] when the chat template writes the model's image
//! placeholder for the image part. Templates that do not (a text-only template that drops list
//! content, or one writing a text marker such as `<image>`) get the InternVL-Chat prompt
//! instead: the placeholder token's text, a newline and the instruction as the message's plain
//! content, expanded and generated directly.
use crate::chat::{ChatFormat, ChatMessage, RenderOptions};
use crate::media::{ImageInput, MediaItem, MediaKind};
use crate::registry::{self, FamilyKind};
use crate::{ChatConfig, ChatSession, GenerateConfig, LoadOptions, Model, ModelError, Result};
use std::path::Path;
use std::sync::Arc;

/// The instruction sent with the image when none is given, by family: Qianfan-OCR's document
/// parsing prompt for InternVL, PaddleOCR-VL's `OCR:`, a plain request otherwise.
pub fn default_prompt(model_type: &str) -> &'static str {
    match model_type {
        "internvl" => "Parse this document to Markdown.",
        "paddleocr_vl" => "OCR:",
        _ => "Read all the text in the image.",
    }
}

/// The reply to one image: the prompt as the model saw it, what it generated.
#[derive(Debug, Clone)]
pub struct OcrReply {
    /// Whether the chat template wrote the image placeholder (else the InternVL-Chat prompt was
    /// used).
    pub templated: bool,
    /// The expanded prompt's ids.
    pub prompt: Vec<u32>,
    /// The generated ids (a stop token excluded), and their text (special tokens skipped).
    pub tokens: Vec<u32>,
    pub text: String,
}

/// A vision-language model ready to read images.
pub struct Ocr {
    session: ChatSession,
    model: Model,
    format: Arc<ChatFormat>,
    model_type: &'static str,
}

impl Ocr {
    /// Load the checkpoint in `dir`, which must be of a vision-language family (registry kind
    /// [`FamilyKind::Vlm`]).
    pub fn load(dir: impl AsRef<Path>, opts: &LoadOptions) -> Result<Self> {
        let dir = dir.as_ref();
        let family = registry::detect_model_type(dir)?;
        if family.kind != FamilyKind::Vlm {
            let vlm: Vec<&str> = registry::FAMILIES
                .iter()
                .filter(|f| f.kind == FamilyKind::Vlm)
                .map(|f| f.model_type)
                .collect();
            return Err(ModelError::WrongKind(format!(
                "{}: family {} reads no images (vision-language families: {})",
                dir.display(),
                family.model_type,
                vlm.join(", ")
            )));
        }
        let model = crate::load_model(dir, opts)?.into_lm()?;
        let session = ChatSession::new(model.clone())?;
        let format = session.format().clone();
        Ok(Ocr {
            session,
            model,
            format,
            model_type: family.model_type,
        })
    }

    /// The canonical family of the model.
    pub fn model_type(&self) -> &'static str {
        self.model_type
    }

    /// The model's reply to `image` with `prompt` (the family's [`default_prompt`] when `None`),
    /// at most `max_tokens` greedy tokens.
    pub fn read(
        &mut self,
        image: ImageInput,
        prompt: Option<&str>,
        max_tokens: usize,
    ) -> Result<OcrReply> {
        let text = prompt.unwrap_or(default_prompt(self.model_type));
        let placeholder = self
            .model
            .with_runtime(|rt| rt.media().and_then(|m| m.placeholder(MediaKind::Image)))
            .ok_or_else(|| {
                ModelError::UnsupportedOption(format!("{} takes no images", self.model_type))
            })?;
        let msg = ChatMessage::user(text).with_image(image.clone());
        let marks = |ids: &[u32]| ids.iter().filter(|&&t| t == placeholder).count();
        if marks(
            &self
                .format
                .render(std::slice::from_ref(&msg), &RenderOptions::default())?
                .ids,
        ) == 1
        {
            let sampling = sampling::SamplingOverrides {
                temperature: Some(0.0),
                ..Default::default()
            };
            let cfg = ChatConfig {
                max_new_tokens: max_tokens,
                sampling,
                ..Default::default()
            };
            let res = self.session.start(vec![msg], &cfg)?;
            let ids = self.session.cached_ids();
            let (prompt, tokens) = (
                ids[..res.prompt_tokens].to_vec(),
                ids[res.prompt_tokens..res.prompt_tokens + res.num_tokens].to_vec(),
            );
            return Ok(OcrReply {
                text: res.text,
                tokens,
                prompt,
                templated: true,
            });
        }
        let marker = self.format.tokenizer().decode(&[placeholder], false)?;
        let ids = self
            .format
            .render(
                &[ChatMessage::user(format!("{marker}\n{text}"))],
                &RenderOptions::default(),
            )?
            .ids;
        if marks(&ids) != 1 {
            return Err(ModelError::InvalidInput(format!(
                "the chat template writes no image placeholder for an image part, and the text {marker:?} does not render as that one token"
            )));
        }
        let (prompt, media) = self.model.with_runtime(|rt| -> Result<_> {
            let m = rt.media().ok_or_else(|| {
                ModelError::UnsupportedOption(format!("{} takes no images", self.model_type))
            })?;
            let prepared = vec![m.prepare(&MediaItem::Image(image))?];
            Ok((m.expand(&ids, &prepared)?, prepared))
        })?;
        let sampling = sampling::SamplingConfig::greedy();
        let cfg = GenerateConfig {
            max_new_tokens: max_tokens,
            sampling,
            stop_tokens: Some(self.format.stop_token_ids()),
            ..Default::default()
        };
        let mut cache = self.model.new_cache();
        let tokens = crate::generate(&self.model, &mut cache, &prompt, cfg)?
            .with_media(media)
            .map(|t| t.map(|t| t.id))
            .collect::<Result<Vec<u32>>>()?;
        let text = self.format.tokenizer().decode(&tokens, true)?;
        Ok(OcrReply {
            text,
            tokens,
            prompt,
            templated: false,
        })
    }
}
