//! Errors as NCCL wants them: an `ncclResult_t` code and a message for the log line.

/// NCCL's `ncclResult_t` values the plugin returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Code {
    /// `ncclSuccess`.
    Success = 0,
    /// `ncclSystemError`: the device or the operating system failed.
    System = 2,
    /// `ncclInternalError`: NCCL used the plugin wrongly (unknown object, bad size).
    Internal = 3,
    /// `ncclInvalidArgument`.
    InvalidArgument = 4,
    /// `ncclInvalidUsage`: the configuration is wrong.
    InvalidUsage = 5,
    /// `ncclRemoteError`: the peer failed or went away.
    Remote = 6,
}

/// An error with its code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetError {
    /// What NCCL is told.
    pub code: Code,
    /// What the log says.
    pub msg: String,
}

/// A result of the plugin's operations.
pub type NetResult<T> = Result<T, NetError>;

impl NetError {
    fn new(code: Code, msg: impl Into<String>) -> NetError {
        NetError {
            code,
            msg: msg.into(),
        }
    }

    /// A device or OS failure.
    pub fn system(msg: impl Into<String>) -> NetError {
        NetError::new(Code::System, msg)
    }

    /// A misuse of the plugin.
    pub fn internal(msg: impl Into<String>) -> NetError {
        NetError::new(Code::Internal, msg)
    }

    /// A bad argument.
    pub fn invalid(msg: impl Into<String>) -> NetError {
        NetError::new(Code::InvalidArgument, msg)
    }

    /// A configuration error.
    pub fn usage(msg: impl Into<String>) -> NetError {
        NetError::new(Code::InvalidUsage, msg)
    }

    /// The peer failed.
    pub fn remote(msg: impl Into<String>) -> NetError {
        NetError::new(Code::Remote, msg)
    }
}

impl std::fmt::Display for NetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}
