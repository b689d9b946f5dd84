//! Text minicri writes for people: strangers' words (a registry's answer, a plugin's message, a
//! pod's command line) made fit for an error message or a log line, bounded and on one line;
//! sizes and durations as people read them.

/// Most characters of a stranger's text (a registry's answer, a plugin's message) kept in an
/// error message.
pub const MAX_MESSAGE_CHARS: usize = 1024;

/// `message` cut to [`MAX_MESSAGE_CHARS`] characters (also for other strangers' text in errors:
/// CNI plugins' messages).
pub fn bounded(message: String) -> String {
    bounded_to(message, MAX_MESSAGE_CHARS)
}

/// `message` cut to `max_chars` characters, marked as cut.
pub fn bounded_to(mut message: String, max_chars: usize) -> String {
    if let Some((at, _)) = message.char_indices().nth(max_chars) {
        message.truncate(at);
        message.push_str("… (cut)");
    }
    message
}

/// Whether `c` may change how the text around it is shown: control characters (line breaks,
/// escape sequences) and Unicode's bidirectional and zero-width formatting characters.
fn is_formatting(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}')
}

/// A stranger's `text` made fit for one line of an error message: every run of whitespace and
/// formatting characters one space, trimmed, cut to `max_chars` characters (marked as cut).
pub fn excerpt(text: &str, max_chars: usize) -> String {
    let mut out = String::new();
    let mut gap = false;
    for c in text.chars() {
        if c.is_whitespace() || is_formatting(c) {
            gap = !out.is_empty();
            continue;
        }
        if gap {
            out.push(' ');
            gap = false;
        }
        out.push(c);
        // Enough to know whether it must be cut.
        if out.len() > max_chars * 4 + 4 {
            break;
        }
    }
    bounded_to(out, max_chars)
}

/// `1.5 GiB`-style sizes for people.
pub fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b.max(0.0);
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

/// `1h05m`, `3m20s`, `42s` for people.
pub fn human_duration(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_cut() {
        assert_eq!(bounded("short".into()), "short");
        let long = "é".repeat(MAX_MESSAGE_CHARS + 10);
        let cut = bounded(long);
        assert_eq!(
            cut.chars().count(),
            MAX_MESSAGE_CHARS + "… (cut)".chars().count()
        );
    }

    #[test]
    fn excerpts_are_one_short_line() {
        assert_eq!(
            excerpt("  a\r\n\tb  \u{1b}[2Jc\u{202e}d\u{0}", 10),
            "a b [2Jc d"
        );
        assert_eq!(excerpt("\n\n", 10), "");
        assert_eq!(excerpt("abcdef", 3), "abc… (cut)");
        // Cut by characters, not bytes; a huge input is not copied whole.
        let long = format!("{}\n{}", "é".repeat(150), "x".repeat(1 << 20));
        let cut = excerpt(&long, 200);
        assert_eq!(
            cut,
            format!("{} {}… (cut)", "é".repeat(150), "x".repeat(49))
        );
    }

    #[test]
    fn people_read_sizes_and_durations() {
        assert_eq!(human_bytes(512.0), "512 B");
        assert_eq!(human_bytes(1.5 * 1024.0 * 1024.0 * 1024.0), "1.5 GiB");
        assert_eq!(human_duration(42.4), "42s");
        assert_eq!(human_duration(200.0), "3m20s");
        assert_eq!(human_duration(3900.0), "1h05m");
    }
}
