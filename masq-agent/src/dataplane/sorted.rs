//! A walk of two sorted sequences side by side, which both data planes diff with.

/// Walks two sequences sorted alike by key, calling `each` once for every key: with its value
/// in `old`, in `new`, or both. The data planes compare what they installed with what they
/// want this way, in one pass and without an index of either.
pub fn walk_sorted<K: Ord, A, B>(
    old: impl IntoIterator<Item = (K, A)>,
    new: impl IntoIterator<Item = (K, B)>,
    mut each: impl FnMut(K, Option<A>, Option<B>),
) {
    let (mut old, mut new) = (old.into_iter().peekable(), new.into_iter().peekable());
    loop {
        let order = match (old.peek(), new.peek()) {
            (Some((o, _)), Some((n, _))) => o.cmp(n),
            (Some(_), None) => std::cmp::Ordering::Less,
            (None, Some(_)) => std::cmp::Ordering::Greater,
            (None, None) => return,
        };
        match order {
            std::cmp::Ordering::Less => {
                if let Some((key, value)) = old.next() {
                    each(key, Some(value), None);
                }
            }
            std::cmp::Ordering::Greater => {
                if let Some((key, value)) = new.next() {
                    each(key, None, Some(value));
                }
            }
            std::cmp::Ordering::Equal => {
                if let (Some((key, a)), Some((_, b))) = (old.next(), new.next()) {
                    each(key, Some(a), Some(b));
                }
            }
        }
    }
}
