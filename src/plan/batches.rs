//! Cutting keys into commands: at most `batch_size` keys and a byte budget each, full-sized
//! across pages (a short remainder is carried to the next page).

/// Fills commands from `keys` (the keys carried from earlier pages, then this page's):
/// `(commands, carry)`. Commands are cut by [`cut_batches`]; unless `last` (the job's last
/// page), a final command short of `batch_size` keys is not written but carried to the next
/// page, so commands are full-sized across pages however sparse the table (at most one
/// command's worth of keys is ever carried).
pub fn fill_commands(
    keys: Vec<String>,
    batch_size: usize,
    max_bytes: usize,
    last: bool,
) -> (Vec<Vec<String>>, Vec<String>) {
    let mut batches = cut_batches(keys, batch_size, max_bytes);
    let short = batches.last().is_some_and(|b| b.len() < batch_size);
    let carry = if short && !last {
        batches.pop().unwrap_or_default()
    } else {
        Vec::new()
    };
    (batches, carry)
}

/// Cuts `keys` into commands of at most `batch_size` keys and `max_bytes` bytes of keys, in
/// order; a key longer than `max_bytes` gets a command of its own.
pub fn cut_batches(keys: Vec<String>, batch_size: usize, max_bytes: usize) -> Vec<Vec<String>> {
    let mut batches: Vec<Vec<String>> = Vec::new();
    let mut bytes = 0;
    for key in keys {
        let full_count = batches.last().is_none_or(|b| b.len() >= batch_size);
        let full_bytes = bytes + key.len() > max_bytes;
        if full_count || (full_bytes && !batches.last().is_none_or(|b| b.is_empty())) {
            batches.push(Vec::new());
            bytes = 0;
        }
        bytes += key.len();
        batches.last_mut().expect("pushed above").push(key);
    }
    batches
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_are_full_across_pages_and_the_last_page_writes_the_rest() {
        let keys = |r: std::ops::Range<usize>| r.map(|i| i.to_string()).collect::<Vec<_>>();
        // 7 keys, batches of 3: two commands, one key carried.
        let (b, carry) = fill_commands(keys(0..7), 3, 1024, false);
        assert_eq!(b, vec![keys(0..3), keys(3..6)]);
        assert_eq!(carry, keys(6..7));
        // A sparse page: fewer than a command's worth, all carried; nothing written.
        let (b, carry) = fill_commands(keys(0..2), 3, 1024, false);
        assert!(b.is_empty());
        assert_eq!(carry, keys(0..2));
        // The last page writes the short command too.
        let (b, carry) = fill_commands(keys(0..7), 3, 1024, true);
        assert_eq!(b.last().unwrap(), &keys(6..7));
        assert!(carry.is_empty());
        assert_eq!(fill_commands(Vec::new(), 3, 1024, false), (vec![], vec![]));
        // Exactly full: nothing carried.
        assert_eq!(
            fill_commands(keys(0..6), 3, 1024, false).1,
            Vec::<String>::new()
        );
    }

    #[test]
    fn batches_are_bounded_by_count_and_by_bytes() {
        let keys = |n: usize, len: usize| (0..n).map(|i| format!("{i:0len$}")).collect::<Vec<_>>();
        let b = cut_batches(keys(7, 1), 3, 1024);
        assert_eq!(b.iter().map(Vec::len).collect::<Vec<_>>(), vec![3, 3, 1]);
        // 4-byte keys, 10 bytes a command: two keys each.
        let b = cut_batches(keys(5, 4), 100, 10);
        assert_eq!(b.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 2, 1]);
        // A key over the byte budget still gets a command.
        let b = cut_batches(vec!["x".repeat(20), "y".into()], 100, 10);
        assert_eq!(b.iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 1]);
        assert!(cut_batches(Vec::new(), 3, 10).is_empty());
    }
}
