//! An intrusive doubly linked list over block indices: O(1) push, pop and unlink of any block.
//! The allocator's free list, least recently used at the front.

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
pub(crate) struct FreeList {
    prev: Vec<u32>,
    next: Vec<u32>,
    linked: Vec<bool>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeList {
    /// A list holding `0..n` in order.
    pub(crate) fn full(n: u32) -> Self {
        Self::holding(n, n)
    }

    /// A list with room for `0..n`, holding `0..held` in order.
    pub(crate) fn holding(n: u32, held: u32) -> Self {
        let mut l = FreeList {
            prev: vec![NIL; n as usize],
            next: vec![NIL; n as usize],
            linked: vec![false; n as usize],
            head: NIL,
            tail: NIL,
            len: 0,
        };
        for i in 0..held.min(n) {
            l.push_back(i);
        }
        l
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn contains(&self, i: u32) -> bool {
        self.linked.get(i as usize).copied().unwrap_or(false)
    }

    /// Append `i` (must not be linked) as the most recently used entry.
    pub(crate) fn push_back(&mut self, i: u32) {
        self.link_between(i, self.tail, NIL);
    }

    /// Prepend `i` (must not be linked): it will be the next one popped.
    pub(crate) fn push_front(&mut self, i: u32) {
        self.link_between(i, NIL, self.head);
    }

    /// Link `i` (must not be linked) between the adjacent entries `p` and `n` (`NIL` at an end).
    fn link_between(&mut self, i: u32, p: u32, n: u32) {
        debug_assert!(!self.linked[i as usize]);
        self.join(p, i);
        self.join(i, n);
        self.linked[i as usize] = true;
        self.len += 1;
    }

    /// Make `n` follow `p` (`NIL` for `p`: `n` is the head; for `n`: `p` is the tail).
    fn join(&mut self, p: u32, n: u32) {
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
    }

    /// Unlink `i` wherever it is; false if it was not linked.
    pub(crate) fn remove(&mut self, i: u32) -> bool {
        if !self.contains(i) {
            return false;
        }
        let iu = i as usize;
        self.join(self.prev[iu], self.next[iu]);
        self.prev[iu] = NIL;
        self.next[iu] = NIL;
        self.linked[iu] = false;
        self.len -= 1;
        true
    }

    /// Unlink and return the least recently used entry.
    pub(crate) fn pop_front(&mut self) -> Option<u32> {
        let h = self.head;
        if h == NIL {
            return None;
        }
        self.remove(h);
        Some(h)
    }

    /// Entries from least to most recently used.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                return None;
            }
            let c = cur;
            cur = self.next[c as usize];
            Some(c)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn push_pop_remove() {
        let mut l = FreeList::full(4);
        assert_eq!(l.iter().collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert!(l.remove(2));
        assert!(!l.remove(2));
        l.push_back(2);
        assert_eq!(l.iter().collect::<Vec<_>>(), [0, 1, 3, 2]);
        assert!(l.remove(3));
        l.push_front(3);
        assert_eq!(l.iter().collect::<Vec<_>>(), [3, 0, 1, 2]);
        assert_eq!((l.pop_front(), l.pop_front()), (Some(3), Some(0)));
        assert_eq!(l.len(), 2);
        assert!(l.remove(2) && l.remove(1));
        assert_eq!(l.pop_front(), None);
    }
}
