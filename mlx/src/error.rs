/// An MLX operation failed: the C++ exception's message, with the op that raised it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("mlx {op}: {message}")]
pub struct Error {
    pub op: &'static str,
    pub message: String,
}

impl Error {
    pub(crate) fn from_cxx(op: &'static str, e: cxx::Exception) -> Self {
        Error { op, message: e.what().to_string() }
    }

    pub(crate) fn new(op: &'static str, message: impl Into<String>) -> Self {
        Error { op, message: message.into() }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
