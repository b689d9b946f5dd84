//! Tests whose prerequisites are missing (root, runc, the CNI plugins): outside CI they skip,
//! saying why; with `MINICRI_TEST_STRICT=1` (hack/test.sh sets it, and so CI) they fail instead,
//! so a green run always means they ran.

/// The environment switch that turns skips into failures.
pub const STRICT_ENV: &str = "MINICRI_TEST_STRICT";

/// Passes `reason` (why a test cannot run here, if it cannot) through, or panics with it when
/// skipping is not allowed.
pub fn missing(reason: Option<String>) -> Option<String> {
    if let Some(why) = &reason
        && std::env::var_os(STRICT_ENV).is_some_and(|v| v != "0" && !v.is_empty())
    {
        panic!(
            "a prerequisite of this test is missing ({why}) and {STRICT_ENV} is set: it must run here"
        );
    }
    reason
}

/// [`missing`] for a test that needs root: returns whether to skip (printing why).
pub fn skip_unless_root() -> bool {
    let why = missing((!nix::unistd::geteuid().is_root()).then(|| "not root".to_string()));
    if let Some(why) = &why {
        eprintln!("skipping: {why}");
    }
    why.is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_missing_is_never_a_failure() {
        assert_eq!(missing(None), None);
    }
}
