//! OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An HTTP error answer.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::invalid(message)
        }
    }
    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("not_found"),
        }
    }
    pub fn queue_full(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: message.into(),
            kind: "rate_limit_error",
            param: None,
            code: Some("queue_full"),
        }
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: Some("unavailable"),
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl From<crate::engine::SubmitError> for ApiError {
    fn from(e: crate::engine::SubmitError) -> Self {
        match e {
            crate::engine::SubmitError::QueueFull { .. } => ApiError::queue_full(e.to_string()),
            crate::engine::SubmitError::ShutDown => ApiError::unavailable(e.to_string()),
            crate::engine::SubmitError::Invalid(m) => ApiError::invalid(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Parse a JSON request body into `T`: 400 for malformed JSON, and for fields of the wrong type
/// or unknown fields (with the field's path as `param`).
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(format!(
            "We could not parse the JSON body of your request: {e}"
        ))
        .with_code("invalid_json")
    })?;
    if !v.is_object() {
        return Err(
            ApiError::invalid("The request body must be a JSON object").with_code("invalid_json")
        );
    }
    serde_path_to_error::deserialize::<_, T>(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        if path == "." {
            ApiError::invalid(format!("Invalid request: {inner}"))
        } else {
            ApiError::invalid_param(path.clone(), format!("Invalid value for '{path}': {inner}"))
        }
    })
}
