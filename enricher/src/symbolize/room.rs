//! Which held parses make room for another: GreedyDual-Size, with admission.
//!
//! Dropping the least recently used parse, whatever its size and whatever it costs to
//! make again, thrashes once the parses a node needs each round do not fit together:
//! on an idle test node an interpreter's 17 MiB of DWARF and libc's 10 MiB (inflated
//! again from its compressed debug file each time) pushed each other out every round,
//! and a big parse dropped every small one older than itself on the way.
//!
//! Each held parse has a credit: the floor when it was last needed (its binary asked for
//! frames, cached or not), plus the time its last parse took per byte it holds. Room
//! comes from the lowest credits first, and the floor rises to the highest credit
//! dropped, so parses not needed for a while age out whatever they cost. A parse whose
//! own credit is below that of a parse it would push out is made for the round and not
//! kept (the floor rises to its credit, so it gets in once the others have gone unasked
//! long enough). While those it would push out are asked every round and dearer a byte,
//! that is never: it stays named from its symbol tables, without file:line, rather than
//! the dearer parse being made again every few rounds (a larger budget holds both).
//!
//! A parse never made has no time of its own: it is credited at what whole parses have
//! cost per byte so far ([`Rate`]). Let in unpriced, a first need of an interpreter's
//! 17 MiB of DWARF on an idle test node dropped libc's and the enricher's own parses,
//! needed every round and dearer per byte, and both were made again the next round
//! (36 ms, a window's whole budget at rest).

/// The floor credits start from.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Floor(f64);

impl Floor {
    /// Credit of a parse needed now, whose last parse took `parse_ns` for `cost` bytes.
    pub(super) fn credit(self, parse_ns: u64, cost: u64) -> f64 {
        // Precision is irrelevant here: credits only order parses.
        #[allow(clippy::cast_precision_loss)]
        let per_byte = parse_ns as f64 / cost.max(1) as f64;
        self.0 + per_byte
    }

    /// Credit of a parse needed now that was never made: at the rate of those made.
    pub(super) fn credit_at(self, rate: Rate) -> Option<f64> {
        rate.per_byte().map(|r| self.0 + r)
    }

    fn raise(&mut self, to: f64) {
        if to > self.0 {
            self.0 = to;
        }
    }
}

/// Time and bytes of the whole parses made so far.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Rate {
    ns: u64,
    bytes: u64,
}

impl Rate {
    pub(super) fn add(&mut self, ns: u64, bytes: u64) {
        self.ns = self.ns.saturating_add(ns);
        self.bytes = self.bytes.saturating_add(bytes);
    }

    /// Nanoseconds a byte, weighted by bytes; None before the first parse.
    fn per_byte(self) -> Option<f64> {
        // Precision is irrelevant here: credits only order parses.
        #[allow(clippy::cast_precision_loss)]
        (self.bytes > 0).then(|| self.ns as f64 / self.bytes as f64)
    }
}

/// What making room for `need` bytes takes.
#[derive(Debug, PartialEq)]
pub(super) enum Room<K> {
    /// They fit already.
    Fits,
    /// Drop these parses (lowest credit first).
    Drop(Vec<K>),
    /// The parses it would push out are worth more: parse for this round only.
    NotKept,
}

/// Plans room for `need` bytes with `free` bytes free, among the parses `held` (key,
/// credit, bytes). `newcomer` is the credit of the parse needing room, None when nothing
/// prices it (no parse made yet: it is let in). The floor rises with what the plan drops
/// or turns away.
pub(super) fn make_room<K>(
    floor: &mut Floor,
    mut held: Vec<(K, f64, u64)>,
    free: u64,
    need: u64,
    newcomer: Option<f64>,
) -> Room<K> {
    if need <= free {
        return Room::Fits;
    }
    held.sort_by(|a, b| a.1.total_cmp(&b.1));
    let mut freed = free;
    let mut top = None;
    let mut victims = Vec::new();
    for (key, credit, cost) in held {
        if freed >= need {
            break;
        }
        if let Some(n) = newcomer.filter(|&n| credit > n) {
            floor.raise(n);
            return Room::NotKept;
        }
        freed = freed.saturating_add(cost);
        top = Some(credit);
        victims.push(key);
    }
    if freed < need {
        // Not even all of them make room (the caller keeps such parses for the
        // round only): drop nothing.
        return Room::NotKept;
    }
    if let Some(t) = top {
        floor.raise(t);
    }
    Room::Drop(victims)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (why, held as (key, credit, bytes), free, need, newcomer, plan, floor after)
    type Case = (
        &'static str,
        Vec<(u8, f64, u64)>,
        u64,
        u64,
        Option<f64>,
        Room<u8>,
        f64,
    );

    #[test]
    fn plans() {
        let cases: &[Case] = &[
            (
                "room enough",
                vec![(1, 5.0, 10)],
                4,
                4,
                Some(0.0),
                Room::Fits,
                0.0,
            ),
            (
                "lowest credit first, not the oldest; no more than needed",
                vec![(1, 3.0, 10), (2, 1.0, 10), (3, 2.0, 10)],
                0,
                15,
                Some(9.0),
                Room::Drop(vec![2, 3]),
                2.0,
            ),
            (
                "the lowest credit frees enough: a small dearer parse stays",
                vec![(1, 1.0, 20), (2, 4.0, 1)],
                0,
                20,
                Some(9.0),
                Room::Drop(vec![1]),
                1.0,
            ),
            (
                "worth less than what it would push out: not kept, the floor rises to it",
                vec![(1, 1.0, 10), (2, 4.0, 10)],
                0,
                15,
                Some(3.0),
                Room::NotKept,
                3.0,
            ),
            (
                "unpriced: let in",
                vec![(1, 7.0, 10)],
                0,
                5,
                None,
                Room::Drop(vec![1]),
                7.0,
            ),
            (
                "all of them would not make room: nothing dropped",
                vec![(1, 1.0, 10)],
                0,
                15,
                None,
                Room::NotKept,
                0.0,
            ),
            (
                "an equal credit lets it in",
                vec![(1, 2.0, 10)],
                0,
                5,
                Some(2.0),
                Room::Drop(vec![1]),
                2.0,
            ),
        ];
        for (why, held, free, need, newcomer, plan, after) in cases {
            let mut floor = Floor::default();
            let got = make_room(&mut floor, held.clone(), *free, *need, *newcomer);
            assert_eq!(&got, plan, "{why}");
            assert!((floor.0 - after).abs() < 1e-9, "{why}: floor {}", floor.0);
        }
    }

    /// The idle node's first wave (the debug log of a rest window at 99 Hz, 24 MiB
    /// budget): libc (10.6 MB, 30 ms) and the enricher (5.8 MB, 9.5 ms) held and needed
    /// this round, then the interpreter's 17.4 MB, never parsed, needs room.
    #[test]
    fn a_first_parse_priced_at_the_others_rate_does_not_push_out_dearer_ones() {
        let mut rate = Rate::default();
        let floor = Floor::default();
        let made = [
            ("libc", 30_000_000, 10_598_222),
            ("enricher", 9_500_000, 5_838_346),
        ];
        let held = made
            .iter()
            .map(|&(k, ns, bytes)| {
                rate.add(ns, bytes);
                (k, floor.credit(ns, bytes), bytes)
            })
            .collect::<Vec<_>>();
        let free = (24 << 20) - 10_598_222 - 5_838_346;
        let mut priced = floor;
        let newcomer = priced.credit_at(rate);
        assert!(newcomer.is_some());
        assert_eq!(
            make_room(&mut priced, held.clone(), free, 17_448_877, newcomer),
            Room::NotKept,
            "made for the round: libc is dearer a byte than the rate"
        );
        let mut unpriced = Floor::default();
        assert_eq!(
            make_room(&mut unpriced, held, free, 17_448_877, None),
            Room::Drop(vec!["enricher", "libc"]),
            "before: both dropped, and parsed again the next round"
        );
        assert_eq!(Floor::default().credit_at(Rate::default()), None);
    }

    /// Two parses that do not fit together, needed in turn: one stays held, the other
    /// is made each time and not kept, instead of each pushing the other out.
    #[test]
    fn alternating_parses_that_do_not_fit_together_settle() {
        const BUDGET: u64 = 20;
        let mut floor = Floor::default();
        // (key, parse ns, bytes): a costs more per byte to make again.
        let parses_of = [('a', 40, 10), ('b', 20, 17)];
        // (key, credit, bytes) of the parse held.
        let mut held: Option<(char, f64, u64)> = None;
        let mut parses = 0;
        for round in 0..20 {
            for (key, ns, bytes) in parses_of {
                if let Some(h) = held.as_mut().filter(|h| h.0 == key) {
                    h.1 = floor.credit(ns, bytes);
                    continue;
                }
                parses += 1;
                let free = BUDGET - held.map_or(0, |h| h.2);
                let newcomer = (round > 0).then(|| floor.credit(ns, bytes));
                match make_room(
                    &mut floor,
                    held.into_iter().collect(),
                    free,
                    bytes,
                    newcomer,
                ) {
                    Room::NotKept => {}
                    Room::Fits | Room::Drop(_) => {
                        held = Some((key, floor.credit(ns, bytes), bytes))
                    }
                }
            }
        }
        assert_eq!(
            held.map(|h| h.0),
            Some('a'),
            "the dearer parse is the one kept"
        );
        assert!(parses <= 20 + 2, "{parses} parses in 20 rounds");
    }
}
