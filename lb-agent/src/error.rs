//! Helpers for error messages that print each cause once.
//!
//! An error either includes its cause in its own message or returns it from `source()`, never
//! both, or `{:#}` (anyhow's chain) repeats it. lb-agent's error types include the cause in their
//! message, so that a plain `{e}` in a log line says everything; aya's errors return it from
//! `source()` instead, so [`Chain`] flattens them into one message.

use std::{error::Error, fmt, io};

/// An error and its causes on one line ("a: b: c"). A cause whose text the previous message
/// already contains is not repeated.
pub struct Chain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut last = self.0.to_string();
        f.write_str(&last)?;
        let mut source = self.0.source();
        while let Some(e) = source {
            let text = e.to_string();
            if !last.contains(&text) {
                write!(f, ": {text}")?;
            }
            last = text;
            source = e.source();
        }
        Ok(())
    }
}

/// The OS error code somewhere in `e`'s chain, if any.
pub fn os_error(e: &(dyn Error + 'static)) -> Option<i32> {
    let mut source = Some(e);
    while let Some(err) = source {
        if let Some(code) = err.downcast_ref::<io::Error>().and_then(io::Error::raw_os_error) {
            return Some(code);
        }
        source = err.source();
    }
    None
}

/// Whether `e` is (or was caused by) EPERM or EACCES: missing capabilities, or file permissions.
pub fn is_permission_denied(e: &(dyn Error + 'static)) -> bool {
    matches!(os_error(e), Some(libc::EPERM | libc::EACCES))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("`BPF_OBJ_GET` failed")]
    struct Syscall(#[source] io::Error);

    #[derive(Debug, thiserror::Error)]
    #[error("`BPF_OBJ_GET` failed")]
    struct Same(#[source] Syscall);

    #[test]
    fn chains_print_each_cause_once() {
        let e = Outer(io::Error::from_raw_os_error(libc::EACCES));
        assert_eq!(Chain(&e).to_string(), "outer: Permission denied (os error 13)");
        assert_eq!(os_error(&e), Some(libc::EACCES));
        assert!(is_permission_denied(&e));
        let e = Same(Syscall(io::Error::from_raw_os_error(libc::EPERM)));
        assert_eq!(
            Chain(&e).to_string(),
            "`BPF_OBJ_GET` failed: Operation not permitted (os error 1)"
        );
        assert!(is_permission_denied(&e));
        assert!(!is_permission_denied(&io::Error::from_raw_os_error(libc::ENOENT)));
    }
}
