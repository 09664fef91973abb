//! Generated sections of the docs: the text between `<!-- NAME:start -->` and
//! `<!-- NAME:end -->` markers, which the benchmark and the budget rewrite, dated.

use std::path::Path;

use anyhow::Context as _;

/// Today, as the generated sections date their figures.
pub fn today() -> String {
    let out = std::process::Command::new("date").arg("+%Y-%m-%d").output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// Replaces the text between `<!-- NAME:start -->` and `<!-- NAME:end -->` in the file at
/// `path` with `section`.
pub fn update_section(path: &Path, name: &str, section: &str) -> anyhow::Result<()> {
    let (start_marker, end_marker) = (
        format!("<!-- {name}:start -->"),
        format!("<!-- {name}:end -->"),
    );
    let text = std::fs::read_to_string(path)?;
    let start = text
        .find(&start_marker)
        .with_context(|| format!("{} has no {start_marker} marker", path.display()))?;
    let end = text
        .find(&end_marker)
        .with_context(|| format!("{} has no {end_marker} marker", path.display()))?;
    let updated = format!(
        "{}{start_marker}\n{section}\n{}",
        &text[..start],
        &text[end..]
    );
    std::fs::write(path, updated)?;
    Ok(())
}
