//! Splitting block-wise work over threads with `std::thread::scope`.
//!
//! Work is cut into pieces of whole blocks and pulled from a shared queue by
//! up to `available_parallelism()` threads (the caller's thread included), so
//! uneven progress balances itself and a failure to spawn a thread only means
//! fewer helpers, never lost work or a panic.

use std::sync::{Mutex, OnceLock};

/// Below this many elements per piece, thread overhead outweighs the gain.
const MIN_ELEMS_PER_PIECE: usize = 1 << 16;
/// Pieces per thread; >1 so a slow thread does not hold up the rest.
const PIECES_PER_THREAD: usize = 4;

fn max_threads() -> usize {
    static THREADS: OnceLock<usize> = OnceLock::new();
    *THREADS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How to cut `n_blocks` blocks of `block_elems` elements: returns
/// `(blocks_per_piece, n_threads)`. `n_threads == 1` means "run inline".
pub(crate) fn plan(n_blocks: usize, block_elems: usize) -> (usize, usize) {
    let n_elems = n_blocks.saturating_mul(block_elems);
    let threads = max_threads();
    if threads <= 1 || n_elems < 2 * MIN_ELEMS_PER_PIECE {
        return (n_blocks.max(1), 1);
    }
    let n_pieces = (n_elems / MIN_ELEMS_PER_PIECE).clamp(1, threads * PIECES_PER_THREAD);
    let per_piece = n_blocks.div_ceil(n_pieces).max(1);
    (per_piece, threads.min(n_blocks.div_ceil(per_piece)))
}

/// Runs `work` on every piece, using up to `n_threads` threads.
pub(crate) fn run_pieces<P, I>(pieces: I, n_threads: usize, work: impl Fn(P) + Sync)
where
    P: Send,
    I: Iterator<Item = P> + Send,
{
    if n_threads <= 1 {
        pieces.for_each(work);
        return;
    }
    let queue = Mutex::new(pieces);
    // A poisoned lock (a worker panicked) just stops the others; the scope
    // then re-raises that panic. Kernels do not panic, so this is moot.
    let next = || queue.lock().ok()?.next();
    let drain = || {
        while let Some(p) = next() {
            work(p);
        }
    };
    std::thread::scope(|s| {
        for _ in 1..n_threads {
            // If the OS refuses a thread, the others (at least ours) drain the queue.
            let _ = std::thread::Builder::new().spawn_scoped(s, drain);
        }
        drain();
    });
}

/// Applies `kernel` to all of `src` (whole blocks of `type_size` bytes)
/// writing `block_size` elements per block into `dst`, in parallel.
pub(crate) fn par_blocks(src: &[u8], dst: &mut [f32], block_size: usize, type_size: usize, kernel: fn(&[u8], &mut [f32])) {
    let (per_piece, n_threads) = plan(src.len() / type_size, block_size);
    let pieces = src.chunks(per_piece * type_size).zip(dst.chunks_mut(per_piece * block_size));
    run_pieces(pieces, n_threads, |(s, d)| kernel(s, d));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_covers_all_blocks() {
        for &(n_blocks, bs) in &[(0, 32), (1, 32), (100, 256), (1 << 20, 32), (12345, 256), (7, 1)] {
            let (per, threads) = plan(n_blocks, bs);
            assert!(per >= 1 && threads >= 1);
            let pieces = n_blocks.div_ceil(per);
            assert!(per * pieces >= n_blocks);
            assert!(threads <= pieces.max(1) && threads <= max_threads());
        }
        assert_eq!(plan(10, 32).1, 1, "small work runs inline");
        assert!(plan(1 << 20, 32).0 * 32 >= MIN_ELEMS_PER_PIECE, "pieces are not tiny");
    }

    #[test]
    fn run_pieces_visits_every_piece_once() {
        let mut out = vec![0u32; 100_000];
        let pieces = out.chunks_mut(1000).enumerate();
        run_pieces(pieces, 4, |(i, chunk)| {
            for (j, v) in chunk.iter_mut().enumerate() {
                *v += (i * 1000 + j) as u32;
            }
        });
        assert!(out.iter().enumerate().all(|(i, &v)| v == i as u32));
    }
}
