//! Reading the text of an image with a vision-language model (what the `ocr` example runs): a
//! fresh conversation of one user message carrying the image and an instruction, decoded
//! greedily through a [`ChatSession`].
use crate::chat::ChatMessage;
use crate::media::ImageInput;
use crate::registry::{self, FamilyKind};
use crate::{ChatConfig, ChatResult, ChatSession, LoadOptions, ModelError, Result};
use std::path::Path;

/// The instruction sent with the image when none is given, by family: Qianfan-OCR's document
/// parsing prompt for InternVL, PaddleOCR-VL's `OCR:`, a plain request otherwise.
pub fn default_prompt(model_type: &str) -> &'static str {
    match model_type {
        "internvl" => "Parse this document to Markdown.",
        "paddleocr_vl" => "OCR:",
        _ => "Read all the text in the image.",
    }
}

/// A vision-language model ready to read images.
pub struct Ocr {
    session: ChatSession,
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
        Ok(Ocr {
            session: crate::load_session(dir, opts)?,
            model_type: family.model_type,
        })
    }

    /// The canonical family of the model.
    pub fn model_type(&self) -> &'static str {
        self.model_type
    }

    /// The session the requests run in (its cache holds the last request).
    pub fn session(&self) -> &ChatSession {
        &self.session
    }

    /// The model's reply to `image` with `prompt` (the family's [`default_prompt`] when `None`),
    /// at most `max_tokens` greedy tokens.
    pub fn read(
        &mut self,
        image: ImageInput,
        prompt: Option<&str>,
        max_tokens: usize,
    ) -> Result<ChatResult> {
        let text = prompt.unwrap_or(default_prompt(self.model_type));
        let sampling = sampling::SamplingOverrides {
            temperature: Some(0.0),
            ..Default::default()
        };
        let cfg = ChatConfig {
            max_new_tokens: max_tokens,
            sampling,
            ..Default::default()
        };
        self.session
            .start(vec![ChatMessage::user(text).with_image(image)], &cfg)
    }
}
