//! Go's formats the messages and `check-config` follow: time.Duration and strconv quoting.

use std::fmt::Write as _;
use std::time::Duration;

pub(super) const NANOS_PER_SECOND: u128 = 1_000_000_000;

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
