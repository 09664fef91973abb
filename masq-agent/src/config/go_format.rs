//! Go's formats the messages, `check-config` and the flags follow: time.Duration, strconv
//! quoting and strconv.ParseBool.

use std::fmt::Write as _;
use std::time::Duration;

pub(super) const NANOS_PER_SECOND: u128 = 1_000_000_000;

/// Parses a boolean the way Go's `strconv.ParseBool` (and so upstream's flags) does.
pub fn parse_go_bool(s: &str) -> Result<bool, String> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        _ => Err(format!("invalid boolean value {s:?}")),
    }
}

/// Go's `time.ParseDuration`: `[-+]?([0-9]*(\.[0-9]*)?[a-z]+)+`, e.g. `1m30s`, `1.5h`, `-1s`,
/// or `0` alone. Returns signed nanoseconds within Go's int64 range; the error text is Go's.
pub fn parse_go_duration(s: &str) -> Result<i128, String> {
    let invalid = || format!("time: invalid duration {}", go_time_quote(s));
    let (negative, mut rest) = match s.as_bytes() {
        [b'-', tail @ ..] => (true, tail),
        [b'+', tail @ ..] => (false, tail),
        all => (false, all),
    };
    if rest == b"0" {
        return Ok(0);
    }
    if rest.is_empty() {
        return Err(invalid());
    }
    let mut total: u128 = 0;
    while let Some(&first) = rest.first() {
        if !(first == b'.' || first.is_ascii_digit()) {
            return Err(invalid());
        }
        let (whole, whole_digits, after) = leading_int(rest).ok_or_else(invalid)?;
        rest = after;
        let (mut fraction, mut scale, mut fraction_digits) = (0, 1.0, 0);
        if let [b'.', after @ ..] = rest {
            (fraction, scale, fraction_digits, rest) = leading_fraction(after);
        }
        if whole_digits == 0 && fraction_digits == 0 {
            return Err(invalid());
        }
        let unit_len = rest
            .iter()
            .position(|&c| c == b'.' || c.is_ascii_digit())
            .unwrap_or(rest.len());
        if unit_len == 0 {
            return Err(format!(
                "time: missing unit in duration {}",
                go_time_quote(s)
            ));
        }
        let (unit, after) = rest.split_at(unit_len);
        rest = after;
        let unit_nanos = unit_nanos(unit).ok_or_else(|| {
            format!(
                "time: unknown unit {} in duration {}",
                go_time_quote(&String::from_utf8_lossy(unit)),
                go_time_quote(s)
            )
        })?;
        total += u128::from(whole) * u128::from(unit_nanos);
        if fraction > 0 {
            // Computed in float64 like Go, so that results agree to the nanosecond.
            total += (fraction as f64 * (unit_nanos as f64 / scale)) as u128;
        }
        // Go's limit: |d| <= 2^63 here, and d <= 2^63-1 once the sign is applied.
        if total > 1 << 63 {
            return Err(invalid());
        }
    }
    let magnitude = i128::try_from(total).map_err(|_| invalid())?;
    if negative {
        Ok(-magnitude)
    } else if magnitude > i128::from(i64::MAX) {
        Err(invalid())
    } else {
        Ok(magnitude)
    }
}

pub(super) fn unit_nanos(unit: &[u8]) -> Option<u64> {
    match unit {
        b"ns" => Some(1),
        // The second and third are the micro sign U+00B5 and the Greek mu U+03BC.
        b"us" | b"\xc2\xb5s" | b"\xce\xbcs" => Some(1_000),
        b"ms" => Some(1_000_000),
        b"s" => Some(1_000_000_000),
        b"m" => Some(60_000_000_000),
        b"h" => Some(3_600_000_000_000),
        _ => None,
    }
}

/// Go's `leadingInt`: the leading digits, their count and the rest; `None` past 2^63.
pub(super) fn leading_int(s: &[u8]) -> Option<(u64, usize, &[u8])> {
    let digits = s.iter().take_while(|c| c.is_ascii_digit()).count();
    let mut value: u64 = 0;
    for &c in &s[..digits] {
        value = value.checked_mul(10)?.checked_add(u64::from(c - b'0'))?;
        if value > 1 << 63 {
            return None;
        }
    }
    Some((value, digits, &s[digits..]))
}

/// Go's `leadingFraction`: digits after the point, as a value and a power-of-ten scale. Digits
/// past u64's precision are consumed but ignored.
pub(super) fn leading_fraction(s: &[u8]) -> (u64, f64, usize, &[u8]) {
    let digits = s.iter().take_while(|c| c.is_ascii_digit()).count();
    let (mut value, mut scale) = (0u64, 1.0f64);
    let mut overflow = false;
    for &c in &s[..digits] {
        if overflow {
            continue;
        }
        match value
            .checked_mul(10)
            .and_then(|v| v.checked_add(u64::from(c - b'0')))
        {
            Some(next) if next <= 1 << 63 => {
                value = next;
                scale *= 10.0;
            }
            _ => overflow = true,
        }
    }
    (value, scale, digits, &s[digits..])
}

/// Go's `time.Duration.String()`: `1m0s`, `1h30m0s`, `1.5s`, `500ms`, `2µs`, `0s`.
pub fn format_go_duration(d: Duration) -> String {
    format_go_nanos(i128::try_from(d.as_nanos()).unwrap_or(i128::MAX))
}

pub(super) fn format_go_nanos(nanos: i128) -> String {
    let magnitude = nanos.unsigned_abs();
    if magnitude == 0 {
        return "0s".to_owned();
    }
    let sign = if nanos < 0 { "-" } else { "" };
    if magnitude < NANOS_PER_SECOND {
        // Below a second Go switches to the largest unit that keeps a whole part.
        let (decimals, unit) = match magnitude {
            0..1_000 => (0, "ns"),
            1_000..1_000_000 => (3, "µs"),
            _ => (6, "ms"),
        };
        let (whole, fraction) = split_decimals(magnitude, decimals);
        return format!("{sign}{whole}{fraction}{unit}");
    }
    let (seconds, fraction) = split_decimals(magnitude, 9);
    let (minutes, seconds) = (seconds / 60, seconds % 60);
    let (hours, minutes) = (minutes / 60, minutes % 60);
    match (hours, minutes) {
        (0, 0) => format!("{sign}{seconds}{fraction}s"),
        (0, _) => format!("{sign}{minutes}m{seconds}{fraction}s"),
        _ => format!("{sign}{hours}h{minutes}m{seconds}{fraction}s"),
    }
}

/// Splits `value` into its whole part and `.fraction` (trailing zeros dropped, empty if zero),
/// where the last `decimals` digits are the fraction.
pub(super) fn split_decimals(value: u128, decimals: u32) -> (u128, String) {
    let divisor = 10u128.pow(decimals);
    let (whole, fraction) = (value / divisor, value % divisor);
    if fraction == 0 {
        return (whole, String::new());
    }
    let digits = format!("{fraction:0width$}", width = decimals as usize);
    (whole, format!(".{}", digits.trim_end_matches('0')))
}

// ---------------------------------------------------------------------------------------------
// Go's quoting

/// Go's `%q` / `strconv.Quote`, close enough for messages.
pub(super) fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\x07' => out.push_str("\\a"),
            '\x08' => out.push_str("\\b"),
            '\x0c' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\x0b' => out.push_str("\\v"),
            c if c.is_ascii_control() => {
                let _ = write!(out, "\\x{:02x}", u32::from(c));
            }
            c if c.is_control() || (c.is_whitespace() && c != ' ') || c == '\u{feff}' => {
                let code = u32::from(c);
                let _ = if code > 0xffff {
                    write!(out, "\\U{code:08x}")
                } else {
                    write!(out, "\\u{code:04x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The quoting of Go's time package: bytes outside printable ASCII as `\xNN`.
pub(super) fn go_time_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if (' '..='\x7f').contains(&c) {
            if c == '"' || c == '\\' {
                out.push('\\');
            }
            out.push(c);
        } else {
            let mut bytes = [0; 4];
            for b in c.encode_utf8(&mut bytes).bytes() {
                let _ = write!(out, "\\x{b:02x}");
            }
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn go_duration_formatting() {
        let ms = Duration::from_millis;
        for (d, text) in [
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(90), "1m30s"),
            (Duration::from_secs(5), "5s"),
            (ms(500), "500ms"),
            (Duration::from_secs(5400), "1h30m0s"),
            (ms(1500), "1.5s"),
            (Duration::ZERO, "0s"),
            (Duration::from_micros(2), "2µs"),
            (Duration::from_nanos(1), "1ns"),
            (Duration::from_nanos(1_500), "1.5µs"),
            (Duration::from_nanos(3_600_000_000_001), "1h0m0.000000001s"),
            (Duration::from_secs(100 * 3600), "100h0m0s"),
        ] {
            assert_eq!(format_go_duration(d), text);
        }
        assert_eq!(format_go_nanos(-1_500_000_000), "-1.5s");
        assert_eq!(
            format_go_nanos(i128::from(i64::MIN)),
            "-2562047h47m16.854775808s"
        );
    }

    #[test]
    fn go_duration_parsing() {
        const S: i128 = 1_000_000_000;
        for (text, nanos) in [
            ("5s", 5 * S),
            ("1m30s", 90 * S),
            ("500ms", S / 2),
            ("-1s", -S),
            ("+1s", S),
            ("0", 0),
            ("-0", 0),
            ("1.5h", 5400 * S),
            (".5s", S / 2),
            ("1.s", S),
            ("1h2m3s4ms5us6ns", 3_723_004_005_006),
            ("2µs", 2000),
            ("2μs", 2000),
            ("3ns", 3),
            ("1.0000000001s", S),
            ("9223372036854775807ns", i128::from(i64::MAX)),
            ("-9223372036854775808ns", i128::from(i64::MIN)),
            ("2562047h47m16.854775807s", i128::from(i64::MAX)),
        ] {
            assert_eq!(parse_go_duration(text), Ok(nanos), "{text}");
        }
        for (text, message) in [
            ("", r#"time: invalid duration """#),
            ("abc", r#"time: invalid duration "abc""#),
            ("-", r#"time: invalid duration "-""#),
            (".s", r#"time: invalid duration ".s""#),
            ("5", r#"time: missing unit in duration "5""#),
            ("00", r#"time: missing unit in duration "00""#),
            ("1s5", r#"time: missing unit in duration "1s5""#),
            ("5 s", r#"time: unknown unit " s" in duration "5 s""#),
            ("5S", r#"time: unknown unit "S" in duration "5S""#),
            (
                "1é",
                r#"time: unknown unit "\xc3\xa9" in duration "1\xc3\xa9""#,
            ),
            (
                "9223372036854775808ns",
                r#"time: invalid duration "9223372036854775808ns""#,
            ),
            ("2562048h", r#"time: invalid duration "2562048h""#),
            (
                "9223372036854775808ns9223372036854775808ns",
                r#"time: invalid duration "9223372036854775808ns9223372036854775808ns""#,
            ),
            (
                "99999999999999999999s",
                r#"time: invalid duration "99999999999999999999s""#,
            ),
        ] {
            assert_eq!(parse_go_duration(text), Err(message.to_owned()), "{text}");
        }
    }

    #[test]
    fn go_duration_round_trips() {
        for nanos in [
            0u64,
            1,
            999,
            1_000,
            1_500,
            999_999,
            1_000_000,
            500_000_000,
            1_000_000_000,
            1_500_000_000,
            59_999_999_999,
            60_000_000_000,
            90_000_000_000,
            3_599_999_999_999,
            5_400_000_000_000,
            86_400_000_000_123,
            i64::MAX as u64,
        ] {
            let d = Duration::from_nanos(nanos);
            let text = format_go_duration(d);
            assert_eq!(parse_go_duration(&text), Ok(i128::from(nanos)), "{text}");
        }
        for nanos in [-1i128, -1_500, -90_000_000_000, i128::from(i64::MIN)] {
            assert_eq!(parse_go_duration(&format_go_nanos(nanos)), Ok(nanos));
        }
    }

    #[test]
    fn go_quoting() {
        assert_eq!(go_quote("a\"b\\c\n\u{1}é"), r#""a\"b\\c\n\x01é""#);
        assert_eq!(go_time_quote("a\"µ\n"), r#""a\"\xc2\xb5\x0a""#);
    }
}
