//! Persistent (copy-on-write, structure-sharing) collections for the worker table.
//!
//! The worker table is an immutable value behind an atomic pointer: bookings read
//! it without a lock, and a registration publishes a new one. Built as flat vectors,
//! each registration copied and re-sorted the whole table, so registering a fleet of
//! n workers cost O(n²) (20,000 registrations took 24 s). These collections share
//! every node a change does not touch: a new version copies only the path to the
//! change, O(log n) nodes of bounded size.
//!
//! - [`SortedSeq`]: items kept in key order in a B+-tree of `Arc` nodes, leaves of up
//!   to [`LEAF`] items stored contiguously (a booking iterating a role's candidates
//!   reads runs of 64 of them), with subtree counts for positional access.
//! - [`SlotVec`]: a vector indexed by a small integer, as a 64-way trie.
//!
//! Removal never merges nodes: a leaf or inner node left empty is dropped, and
//! underfull ones stay; the height is bounded by the most items ever held.

use std::sync::Arc;

/// Most items in a leaf.
pub const LEAF: usize = 64;
/// Most children of an inner node.
const FAN: usize = 32;

/// What [`SortedSeq`] orders its items by.
pub trait Keyed {
    type Key: Ord + Copy + std::fmt::Debug;
    fn key(&self) -> Self::Key;
}

#[derive(Debug)]
enum Node<T: Keyed> {
    Leaf(Vec<T>),
    Inner {
        children: Vec<Arc<Node<T>>>,
        /// Items under each child.
        counts: Vec<usize>,
        /// Each child's smallest key.
        firsts: Vec<T::Key>,
    },
}

impl<T: Keyed + Clone> Node<T> {
    fn count(&self) -> usize {
        match self {
            Node::Leaf(items) => items.len(),
            Node::Inner { counts, .. } => counts.iter().sum(),
        }
    }

    fn first(&self) -> Option<T::Key> {
        match self {
            Node::Leaf(items) => items.first().map(Keyed::key),
            Node::Inner { firsts, .. } => firsts.first().copied(),
        }
    }

    fn inner(children: Vec<Arc<Node<T>>>) -> Self {
        let counts = children.iter().map(|c| c.count()).collect();
        let firsts = children.iter().filter_map(|c| c.first()).collect();
        Node::Inner {
            children,
            counts,
            firsts,
        }
    }

    /// The child of an inner node `key` belongs under.
    fn child_for(firsts: &[T::Key], key: T::Key) -> usize {
        firsts.partition_point(|k| *k <= key).saturating_sub(1)
    }

    /// This node with `item` put in place (replacing an item of its key): one
    /// node, or two if it split. Returns whether the item is new.
    fn upsert(&self, item: T) -> (Vec<Arc<Node<T>>>, bool) {
        match self {
            Node::Leaf(items) => {
                let mut items = items.clone();
                let added = match items.binary_search_by_key(&item.key(), Keyed::key) {
                    Ok(at) => {
                        items[at] = item;
                        false
                    }
                    Err(at) => {
                        items.insert(at, item);
                        true
                    }
                };
                if items.len() > LEAF {
                    let right = items.split_off(items.len() / 2);
                    (
                        vec![Arc::new(Node::Leaf(items)), Arc::new(Node::Leaf(right))],
                        added,
                    )
                } else {
                    (vec![Arc::new(Node::Leaf(items))], added)
                }
            }
            Node::Inner {
                children, firsts, ..
            } => {
                let at = Self::child_for(firsts, item.key());
                let (replacement, added) = children[at].upsert(item);
                let mut children = children.clone();
                children.splice(at..=at, replacement);
                if children.len() > FAN {
                    let right = children.split_off(children.len() / 2);
                    (
                        vec![
                            Arc::new(Node::inner(children)),
                            Arc::new(Node::inner(right)),
                        ],
                        added,
                    )
                } else {
                    (vec![Arc::new(Node::inner(children))], added)
                }
            }
        }
    }

    /// This node without the item of `key`: `None` if it is not here (nothing
    /// changes), `Some(None)` if the node is left empty.
    fn remove(&self, key: T::Key) -> Option<Option<Arc<Node<T>>>> {
        match self {
            Node::Leaf(items) => {
                let at = items.binary_search_by_key(&key, Keyed::key).ok()?;
                let mut items = items.clone();
                items.remove(at);
                Some((!items.is_empty()).then(|| Arc::new(Node::Leaf(items))))
            }
            Node::Inner {
                children, firsts, ..
            } => {
                let at = Self::child_for(firsts, key);
                let replacement = children[at].remove(key)?;
                let mut children = children.clone();
                match replacement {
                    Some(child) => children[at] = child,
                    None => {
                        children.remove(at);
                    }
                }
                Some((!children.is_empty()).then(|| Arc::new(Node::inner(children))))
            }
        }
    }

    fn get(&self, key: T::Key) -> Option<&T> {
        match self {
            Node::Leaf(items) => items
                .binary_search_by_key(&key, Keyed::key)
                .ok()
                .map(|at| &items[at]),
            Node::Inner {
                children, firsts, ..
            } => children[Self::child_for(firsts, key)].get(key),
        }
    }

    fn at(&self, mut index: usize) -> Option<&T> {
        match self {
            Node::Leaf(items) => items.get(index),
            Node::Inner {
                children, counts, ..
            } => {
                for (child, count) in children.iter().zip(counts) {
                    if index < *count {
                        return child.at(index);
                    }
                    index -= count;
                }
                None
            }
        }
    }
}

/// Items in key order, persistent: [`Self::upsert`] and [`Self::remove`] return a
/// new version sharing every node they did not touch (O(log n) copied).
#[derive(Debug)]
pub struct SortedSeq<T: Keyed> {
    root: Option<Arc<Node<T>>>,
    len: usize,
}

impl<T: Keyed> Clone for SortedSeq<T> {
    fn clone(&self) -> Self {
        Self {
            root: self.root.clone(),
            len: self.len,
        }
    }
}

impl<T: Keyed> Default for SortedSeq<T> {
    fn default() -> Self {
        Self { root: None, len: 0 }
    }
}

impl<T: Keyed + Clone> SortedSeq<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A version with `item` in its place (replacing the item of its key, if any).
    pub fn upsert(&self, item: T) -> Self {
        let Some(root) = &self.root else {
            return Self {
                root: Some(Arc::new(Node::Leaf(vec![item]))),
                len: 1,
            };
        };
        let (mut nodes, added) = root.upsert(item);
        let root = if nodes.len() == 1 {
            nodes.pop()
        } else {
            Some(Arc::new(Node::inner(nodes)))
        };
        Self {
            root,
            len: self.len + usize::from(added),
        }
    }

    /// A version without the item of `key` (the same, if there is none).
    pub fn remove(&self, key: T::Key) -> Self {
        let Some(root) = &self.root else {
            return self.clone();
        };
        match root.remove(key) {
            None => self.clone(),
            Some(mut root) => {
                // A root left with one inner child gives way to it.
                while let Some(Node::Inner { children, .. }) = root.as_deref() {
                    if children.len() != 1 {
                        break;
                    }
                    root = Some(Arc::clone(&children[0]));
                }
                Self {
                    root,
                    len: self.len - 1,
                }
            }
        }
    }

    pub fn get(&self, key: T::Key) -> Option<&T> {
        self.root.as_ref()?.get(key)
    }

    /// The item at `index` in key order.
    pub fn at(&self, index: usize) -> Option<&T> {
        self.root.as_ref()?.at(index)
    }

    /// Every item in key order.
    pub fn iter(&self) -> Iter<'_, T> {
        let mut iter = Iter {
            stack: Vec::new(),
            leaf: [].iter(),
        };
        if let Some(root) = &self.root {
            iter.descend(root);
        }
        iter
    }
}

impl<T: Keyed + Clone> std::ops::Index<usize> for SortedSeq<T> {
    type Output = T;
    fn index(&self, index: usize) -> &T {
        match self.at(index) {
            Some(item) => item,
            None => panic!("index {index} out of range for a sequence of {}", self.len),
        }
    }
}

impl<'a, T: Keyed + Clone> IntoIterator for &'a SortedSeq<T> {
    type Item = &'a T;
    type IntoIter = Iter<'a, T>;
    fn into_iter(self) -> Iter<'a, T> {
        self.iter()
    }
}

/// [`SortedSeq::iter`]: leaf by leaf, each leaf a contiguous run.
pub struct Iter<'a, T: Keyed> {
    /// Inner nodes on the way, with the next child to visit.
    stack: Vec<(&'a [Arc<Node<T>>], usize)>,
    leaf: std::slice::Iter<'a, T>,
}

impl<'a, T: Keyed> Iter<'a, T> {
    fn descend(&mut self, mut node: &'a Node<T>) {
        loop {
            match node {
                Node::Leaf(items) => {
                    self.leaf = items.iter();
                    return;
                }
                Node::Inner { children, .. } => {
                    self.stack.push((children, 1));
                    match children.first() {
                        Some(first) => node = first,
                        None => return,
                    }
                }
            }
        }
    }
}

impl<'a, T: Keyed> Iterator for Iter<'a, T> {
    type Item = &'a T;
    fn next(&mut self) -> Option<&'a T> {
        loop {
            if let Some(item) = self.leaf.next() {
                return Some(item);
            }
            let (children, next) = self.stack.last_mut()?;
            match children.get(*next) {
                Some(child) => {
                    *next += 1;
                    self.descend(child);
                }
                None => {
                    self.stack.pop();
                }
            }
        }
    }
}

/// Bits of a slot each trie level takes.
const BITS: u32 = 6;
const WIDTH: usize = 1 << BITS;

#[derive(Debug)]
enum Trie<T> {
    Leaf(Vec<T>),
    Inner(Vec<Option<Arc<Trie<T>>>>),
}

/// A vector indexed by slot, persistent: [`Self::set`] returns a new version that
/// copies only the path to the slot (64-way trie, O(log n)); an unset slot reads
/// as `T::default()`.
#[derive(Debug)]
pub struct SlotVec<T> {
    root: Option<Arc<Trie<T>>>,
    /// Levels above the leaves.
    depth: u32,
}

impl<T> Clone for SlotVec<T> {
    fn clone(&self) -> Self {
        Self {
            root: self.root.clone(),
            depth: self.depth,
        }
    }
}

impl<T> Default for SlotVec<T> {
    fn default() -> Self {
        Self {
            root: None,
            depth: 0,
        }
    }
}

impl<T: Clone + Default> SlotVec<T> {
    fn capacity(depth: u32) -> usize {
        1usize.checked_shl(BITS * (depth + 1)).unwrap_or(usize::MAX)
    }

    pub fn get(&self, slot: usize) -> Option<&T> {
        if slot >= Self::capacity(self.depth) {
            return None;
        }
        let mut node = self.root.as_deref()?;
        let mut level = self.depth;
        loop {
            let at = (slot >> (BITS * level)) & (WIDTH - 1);
            match node {
                Trie::Leaf(items) => return items.get(at),
                Trie::Inner(children) => {
                    node = children.get(at)?.as_deref()?;
                    level = level.checked_sub(1)?;
                }
            }
        }
    }

    /// A version with `value` in `slot`.
    pub fn set(&self, slot: usize, value: T) -> Self {
        let mut root = self.root.clone();
        let mut depth = self.depth;
        while slot >= Self::capacity(depth) {
            let mut children = vec![None; WIDTH];
            children[0] = root.take();
            root = Some(Arc::new(Trie::Inner(children)));
            depth += 1;
        }
        Self {
            root: Some(Self::set_in(root.as_deref(), depth, slot, value)),
            depth,
        }
    }

    fn set_in(node: Option<&Trie<T>>, level: u32, slot: usize, value: T) -> Arc<Trie<T>> {
        let at = (slot >> (BITS * level)) & (WIDTH - 1);
        if level == 0 {
            let mut items = match node {
                Some(Trie::Leaf(items)) => items.clone(),
                _ => vec![T::default(); WIDTH],
            };
            items[at] = value;
            return Arc::new(Trie::Leaf(items));
        }
        let mut children = match node {
            Some(Trie::Inner(children)) => children.clone(),
            _ => vec![None; WIDTH],
        };
        let below = children[at].as_deref();
        children[at] = Some(Self::set_in(below, level - 1, slot, value));
        Arc::new(Trie::Inner(children))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq)]
    struct Item(u32, &'static str);

    impl Keyed for Item {
        type Key = u32;
        fn key(&self) -> u32 {
            self.0
        }
    }

    /// Against a sorted vector, through splits, replacements, removals and old
    /// versions that must not change.
    #[test]
    fn a_sorted_seq_matches_a_sorted_vector_and_old_versions_stay() {
        let mut seq = SortedSeq::default();
        let mut model: Vec<u32> = Vec::new();
        let mut versions = Vec::new();
        // A fixed pseudo-random order, several leaves and inner levels deep.
        let mut x: u32 = 12345;
        for step in 0..20_000u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
            let key = (x >> 8) % 5_000;
            if step % 5 == 4 {
                seq = seq.remove(key);
                model.retain(|k| *k != key);
            } else {
                seq = seq.upsert(Item(key, "v"));
                if let Err(at) = model.binary_search(&key) {
                    model.insert(at, key);
                }
            }
            if step % 4_000 == 0 {
                versions.push((seq.clone(), model.clone()));
            }
        }
        let check = |seq: &SortedSeq<Item>, model: &[u32]| {
            assert_eq!(seq.len(), model.len());
            assert!(seq.iter().map(|i| i.0).eq(model.iter().copied()));
            for (i, key) in model.iter().enumerate().step_by(97) {
                assert_eq!(seq.at(i).map(|i| i.0), Some(*key));
                assert_eq!(seq[i].0, *key);
                assert_eq!(seq.get(*key).map(|i| i.0), Some(*key));
            }
            assert_eq!(seq.at(model.len()), None);
        };
        check(&seq, &model);
        for (seq, model) in &versions {
            check(seq, model);
        }
        // Replacing keeps the length; removing everything empties it.
        let replaced = seq.upsert(Item(model[0], "w"));
        assert_eq!(replaced.len(), seq.len());
        assert_eq!(replaced.get(model[0]).map(|i| i.1), Some("w"));
        assert_eq!(seq.get(model[0]).map(|i| i.1), Some("v"));
        let mut empty = seq.clone();
        for key in &model {
            empty = empty.remove(*key);
        }
        assert!(empty.is_empty() && empty.iter().next().is_none());
    }

    /// Every node of a version, as addresses.
    fn nodes<T: Keyed>(seq: &SortedSeq<T>) -> Vec<usize> {
        fn walk<T: Keyed>(node: &Arc<Node<T>>, out: &mut Vec<usize>) {
            out.push(Arc::as_ptr(node) as usize);
            if let Node::Inner { children, .. } = &**node {
                for child in children {
                    walk(child, out);
                }
            }
        }
        let mut out = Vec::new();
        if let Some(root) = &seq.root {
            walk(root, &mut out);
        }
        out
    }

    /// A change copies the path to it — a few nodes — not the sequence: counted
    /// at 20,000 items, where a flat copy would be every one of ~300 leaves.
    #[test]
    fn a_change_copies_a_path_not_the_whole_sequence() {
        let mut seq = SortedSeq::default();
        for key in 0..20_000u32 {
            seq = seq.upsert(Item(key * 2, "v"));
        }
        let before: std::collections::HashSet<usize> = nodes(&seq).into_iter().collect();
        assert!(before.len() > 300, "{}", before.len());
        for changed in [
            seq.upsert(Item(10_001, "new")),
            seq.upsert(Item(20_000, "replaced")),
            seq.remove(30_000),
        ] {
            let new = nodes(&changed)
                .into_iter()
                .filter(|n| !before.contains(n))
                .count();
            // The leaf and each inner node above it (four levels here), one more
            // a level where a node splits.
            assert!(new <= 8, "{new} nodes copied");
        }
    }

    #[test]
    fn a_slot_vec_grows_and_keeps_old_versions() {
        let mut v: SlotVec<u32> = SlotVec::default();
        assert_eq!(v.get(0), None);
        v = v.set(3, 30);
        let old = v.clone();
        v = v.set(100_000, 7);
        v = v.set(3, 31);
        assert_eq!(v.get(3), Some(&31));
        assert_eq!(v.get(4), Some(&0));
        assert_eq!(v.get(100_000), Some(&7));
        assert_eq!(old.get(3), Some(&30));
        assert_eq!(old.get(100_000), None);
    }
}
