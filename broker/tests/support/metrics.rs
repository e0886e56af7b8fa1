//! Reading a Prometheus text exposition, as a scraper would.

/// The value of one series (its name and labels, exactly as exposed) in Prometheus text.
pub fn metric(text: &str, series: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}
