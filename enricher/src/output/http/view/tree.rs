//! The call tree the view builds: nodes in an arena with one edge map, names interned
//! by their allocation, and the frozen tree the page receives.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Node, MAX_NODES};

/// Hashes small integer ids with one multiplication (the keys here are our own dense
/// ids, so SipHash's protection buys nothing and cost most of the time).
#[derive(Default, Clone, Copy)]
pub(super) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        // splitmix64's finalizer: every input bit reaches the low (bucket) and high
        // (tag) bits that hashbrown uses.
        let mut x = self.0;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n);
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }

    fn write_usize(&mut self, n: usize) {
        self.0 = n as u64;
    }
}

pub(super) type IdMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<IdHasher>>;

/// The merged call tree as it is built: nodes in an arena, edges (parent, name) →
/// child in one map, so a step down the tree is one hash lookup and no allocation.
pub(super) struct Tree {
    pub(super) name: Vec<u32>,
    pub(super) value: Vec<u64>,
    /// The off-CPU part of each node's value.
    pub(super) off: Vec<u64>,
    pub(super) edges: IdMap<u64, u32>,
}

impl Tree {
    pub(super) fn new(root_name: u32) -> Self {
        Self {
            name: vec![root_name],
            value: vec![0],
            off: vec![0],
            edges: IdMap::default(),
        }
    }

    /// The child of `parent` named `name`; None when it is new and the tree is full.
    pub(super) fn child(&mut self, parent: u32, name: u32) -> Option<u32> {
        let next = self.name.len() as u32;
        let key = u64::from(parent) << 32 | u64::from(name);
        if self.name.len() >= MAX_NODES {
            return self.edges.get(&key).copied();
        }
        let id = *self.edges.entry(key).or_insert(next);
        if id == next {
            self.name.push(name);
            self.value.push(0);
            self.off.push(0);
        }
        Some(id)
    }
}

pub(super) struct Names {
    /// By the name's allocation: frames share their names' `Arc`s (the symbolizer's
    /// frame cache), so most lookups hash a pointer, not a string. The `Arc` is kept so
    /// that its address cannot be reused for another name meanwhile.
    pub(super) by_ptr: IdMap<usize, (Arc<str>, u32)>,
    pub(super) index: HashMap<Arc<str>, u32>,
    pub(super) list: Vec<String>,
}

impl Names {
    pub(super) fn id(&mut self, s: &Arc<str>) -> u32 {
        let ptr = Arc::as_ptr(s) as *const u8 as usize;
        if let Some((_, i)) = self.by_ptr.get(&ptr) {
            return *i;
        }
        let i = match self.index.get(s) {
            Some(&i) => i,
            None => {
                let i = self.list.len() as u32;
                self.list.push(s.to_string());
                self.index.insert(s.clone(), i);
                i
            }
        };
        self.by_ptr.insert(ptr, (s.clone(), i));
        i
    }
}

/// Renumbers the names of the kept nodes densely; the others are not sent.
pub(super) fn remap(
    n: &mut Node,
    map: &mut IdMap<u32, u32>,
    kept: &mut Vec<String>,
    names: &[String],
) {
    let next = kept.len() as u32;
    n.0 = *map.entry(n.0).or_insert_with(|| {
        kept.push(names[n.0 as usize].clone());
        next
    });
    for c in &mut n.2 {
        remap(c, map, kept, names);
    }
}

/// The tree to send: children busiest first; children under `min` samples fold into
/// one `[…]` child of their parent (counted in `folded`).
pub(super) fn freeze(t: &Tree, min: u64, other: u32, folded: &mut u64) -> Node {
    let mut kids: Vec<Vec<u32>> = vec![Vec::new(); t.name.len()];
    // Per parent: (value, off-CPU part) of its folded children.
    let mut small: Vec<(u64, u64)> = vec![(0, 0); t.name.len()];
    for (&edge, &child) in &t.edges {
        let parent = (edge >> 32) as usize;
        let v = t.value[child as usize];
        if v >= min {
            kids[parent].push(child);
        } else {
            small[parent].0 += v;
            small[parent].1 += t.off[child as usize];
            *folded += 1;
        }
    }
    fn node(t: &Tree, kids: &[Vec<u32>], small: &[(u64, u64)], i: u32, other: u32) -> Node {
        let mut ks = kids[i as usize].clone();
        ks.sort_by(|a, b| {
            t.value[*b as usize]
                .cmp(&t.value[*a as usize])
                .then(t.name[*a as usize].cmp(&t.name[*b as usize]))
        });
        let mut out: Vec<Node> = ks.iter().map(|&k| node(t, kids, small, k, other)).collect();
        let (v, off) = small[i as usize];
        if v > 0 {
            out.push(Node(other, v, Vec::new(), off));
        }
        Node(
            t.name[i as usize],
            t.value[i as usize],
            out,
            t.off[i as usize],
        )
    }
    node(t, &kids, &small, 0, other)
}
