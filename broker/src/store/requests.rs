//! What one operators' request page selects: operations that need an operator's approval,
//! newest first (`created_at`, ties by id, both descending), filtered by state, client,
//! operation and target fields, after a position.

use unyolo_admission::engine::OperationState;

/// Which states a page shows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum StateFilter {
    /// Every state.
    #[default]
    Any,
    /// Only these.
    In(Vec<OperationState>),
    /// All but these.
    NotIn(Vec<OperationState>),
}

/// What one request page selects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestQuery {
    /// The operations whose rows are requests here (those that need approval, narrowed by the
    /// query's filters); empty selects nothing.
    pub operations: Vec<String>,
    /// Which states.
    pub states: StateFilter,
    /// Only this client's.
    pub requester: Option<String>,
    /// Target fields: each name must hold the value. A field given several distinct values
    /// matches nothing (a field holds one). A field is compared with a value (one text from the
    /// query string) the same way on every store:
    ///
    /// - a string by its text, exactly (`"1.5"` matches `1.5` but not `1.50`; upstream's
    ///   target fields are all strings);
    /// - a number by its value: the filter must be a JSON number too, and both are read as the
    ///   nearest double, so `1.50`, `1.5` and `15e-1` are one number, as are `10`, `10.0` and
    ///   `1e1`; a number (field or filter) written in more than 1000 characters, or with an
    ///   exponent of 1000 or more in magnitude, matches nothing;
    /// - `true`, `false` and `null` by their JSON text (`true` matches `true`, never `1`; a
    ///   missing field is not `null`);
    /// - an object or an array matches no filter.
    pub target: Vec<(String, Vec<String>)>,
    /// Only requests older than this position: (`created_at`, id) of the previous page's last.
    pub before: Option<(String, String)>,
    /// At most this many.
    pub limit: u32,
}

/// The longest JSON text of a number a target filter compares (see [`RequestQuery::target`]).
pub(crate) const NUMBER_TEXT_MAX: usize = 1000;

/// A target filter's value read as a number (see [`RequestQuery::target`]): JSON's number grammar
/// (`-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`, nothing around it), at most
/// [`NUMBER_TEXT_MAX`] characters with an exponent under 1000 in magnitude, as the nearest
/// double; `None` for any other text, which then matches no number field.
pub(crate) fn filter_number(text: &str) -> Option<f64> {
    if text.len() > NUMBER_TEXT_MAX {
        return None;
    }
    let bytes = text.as_bytes();
    let digits = |from: usize| {
        bytes[from..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count()
    };
    let mut at = usize::from(bytes.first() == Some(&b'-'));
    let whole = digits(at);
    if whole == 0 || (whole > 1 && bytes[at] == b'0') {
        return None;
    }
    at += whole;
    if bytes.get(at) == Some(&b'.') {
        let fraction = digits(at + 1);
        if fraction == 0 {
            return None;
        }
        at += 1 + fraction;
    }
    if matches!(bytes.get(at), Some(b'e' | b'E')) {
        at += 1;
        if matches!(bytes.get(at), Some(b'+' | b'-')) {
            at += 1;
        }
        let exponent = digits(at);
        let significant = bytes[at..at + exponent].iter().skip_while(|b| **b == b'0');
        if exponent == 0 || significant.count() > 3 {
            return None;
        }
        at += exponent;
    }
    if at != bytes.len() {
        return None;
    }
    text.parse::<f64>().ok().filter(|n| n.is_finite())
}

#[cfg(test)]
mod tests {
    use super::filter_number;

    #[test]
    fn a_filter_is_a_number_only_in_json_number_grammar() {
        for (text, number) in [
            ("1.5", 1.5),
            ("1.50", 1.5),
            ("15e-1", 1.5),
            ("1e1", 10.0),
            ("10", 10.0),
            ("-0", 0.0),
            ("-2.25E+0002", -225.0),
            ("1e-400", 0.0),
        ] {
            assert_eq!(filter_number(text), Some(number), "{text}");
        }
        for text in [
            "", "-", "+1", ".5", "1.", "01", "1e", "1e+", " 1", "1 ", "0x10", "NaN", "inf",
            "1e400", "1e1000", "1e-1000", "true", "1_000",
        ] {
            assert_eq!(filter_number(text), None, "{text:?}");
        }
        assert_eq!(filter_number("1e0999"), None, "above a double");
        assert_eq!(filter_number("1e-0999"), Some(0.0));
    }
}
