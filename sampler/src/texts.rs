//! Texts that repeat across process records, held once. Under a churn of short-lived
//! processes every child of one program has the same executable, the same library
//! paths, the same cgroup file and mostly the same command line; the table keeps two
//! rounds of ended records, so unshared copies of these were most of the sampler's
//! memory there.

use std::collections::HashSet;
use std::rc::Rc;

use crate::procfs::{ProcessRecord, Text};

/// Distinct texts held at most. Past it new texts stay unshared (still correct, only
/// bigger): a local user making endless distinct paths cannot grow the set without
/// bound, and every text in it is held by a record the table bounds by bytes, once a
/// sweep has run.
const MAX_TEXTS: usize = 64 << 10;

#[derive(Default)]
pub(crate) struct Texts {
    set: HashSet<Text>,
}

impl Texts {
    /// The shared copy of `t` (taken into the set if new and there is room).
    fn share_one(&mut self, t: &mut Text) {
        if t.is_empty() {
            return;
        }
        if let Some(held) = self.set.get(&**t) {
            if !Rc::ptr_eq(held, t) {
                *t = held.clone();
            }
        } else if self.set.len() < MAX_TEXTS {
            self.set.insert(t.clone());
        }
    }

    /// Makes `r`'s texts the shared copies, and its lists exactly as long as they are
    /// and in address order (what the table's `covers` searches).
    pub(crate) fn share(&mut self, r: &mut ProcessRecord) {
        self.share_one(&mut r.exe);
        self.share_one(&mut r.cgroup);
        self.share_one(&mut r.cmdline);
        for m in &mut r.mappings {
            self.share_one(&mut m.path);
        }
        if !r.mappings.is_sorted_by_key(|m| m.start) {
            r.mappings.sort_by_key(|m| m.start);
        }
        if !r.code.is_sorted() {
            r.code.sort_unstable();
        }
        r.mappings.shrink_to_fit();
        r.code.shrink_to_fit();
    }

    /// Drops the texts no record holds any more.
    pub(crate) fn sweep(&mut self) {
        self.set.retain(|t| Rc::strong_count(t) > 1);
        if self.set.capacity() > 4 * self.set.len().max(256) {
            self.set.shrink_to_fit();
        }
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.set.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procfs::Mapping;

    fn child() -> ProcessRecord {
        ProcessRecord {
            exe: Rc::from(&b"/usr/bin/child"[..]),
            cgroup: Rc::from(&b"0::/user.slice\n"[..]),
            cmdline: Rc::from(&b"child\0-x\0"[..]),
            mappings: vec![Mapping {
                path: Rc::from(&b"/usr/lib/libc.so.6"[..]),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    #[test]
    fn equal_texts_are_held_once_and_swept_with_their_records() {
        let mut texts = Texts::default();
        let (mut a, mut b) = (child(), child());
        texts.share(&mut a);
        texts.share(&mut b);
        assert!(Rc::ptr_eq(&a.exe, &b.exe) && Rc::ptr_eq(&a.cgroup, &b.cgroup));
        assert!(Rc::ptr_eq(&a.cmdline, &b.cmdline));
        assert!(Rc::ptr_eq(&a.mappings[0].path, &b.mappings[0].path));
        assert_eq!(&*b.exe, b"/usr/bin/child", "the text is unchanged");
        assert_eq!(texts.len(), 4);
        drop(a);
        texts.sweep();
        assert_eq!(texts.len(), 4, "b still holds them");
        drop(b);
        texts.sweep();
        assert_eq!(texts.len(), 0);
    }

    #[test]
    fn past_the_bound_texts_stay_unshared() {
        let mut texts = Texts::default();
        let mut held = Vec::new();
        for i in 0..MAX_TEXTS {
            let mut t: Text = Rc::from(format!("/p/{i}").as_bytes());
            texts.share_one(&mut t);
            held.push(t);
        }
        let mut r = child();
        let exe = r.exe.clone();
        texts.share(&mut r);
        assert_eq!(texts.len(), MAX_TEXTS);
        assert!(Rc::ptr_eq(&r.exe, &exe), "kept as it was");
    }
}
