//! The prefix cache's disk tier: files of KV state that RAM could not keep
//! (idle sessions' histories first), one per prefix-cache entry, written
//! once, read back when the entry is wanted again, removed when it is
//! taken back into RAM, evicted from the tier, or its session ends.
//!
//! Files are written, read (and their checksums checked) and removed by one
//! thread of the tier's own, in the order the engine asks, so a step never
//! waits on the disk for a spill; reading waits for that entry's write if
//! it is still queued. A session coming back can have its files read ahead
//! ([`DiskTier::prefetch`]) while its request waits for a row.
//!
//! Each tier writes into a folder of its own under the configured one,
//! named after the process, and removes it when the engine stops; folders
//! left by a process that no longer runs are removed when a tier starts.
//! What a file holds, and how a damaged one is told apart, is
//! [`crate::models::kv_file`]'s.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use crate::models::kv_file::{self, Encoded};

/// Where the tier writes and how many bytes of files it may keep.
#[derive(Clone, Debug)]
pub struct DiskTierConfig {
    pub dir: PathBuf,
    pub budget_bytes: usize,
}

/// Names an entry's file; the prefix cache's entry id.
pub(super) type FileId = u64;

enum Job {
    Write { id: FileId, file: Encoded },
    Remove { id: FileId },
    Read { id: FileId },
}

/// A finished read: the file's bytes, checked whole.
type Read = (FileId, std::io::Result<Vec<u8>>);

pub(super) struct DiskTier {
    dir: PathBuf,
    budget_bytes: usize,
    jobs: Option<Sender<Job>>,
    reads: Receiver<Read>,
    thread: Option<JoinHandle<()>>,
    /// Reads queued (`None`) or done (`Some`), not yet taken.
    read_ahead: HashMap<FileId, Option<std::io::Result<Vec<u8>>>>,
}

/// Tells the tiers of one process apart (one per engine).
static NEXT_TIER: AtomicU64 = AtomicU64::new(0);
const FOLDER_PREFIX: &str = "tether-kv-";

impl DiskTier {
    pub fn new(config: &DiskTierConfig) -> std::io::Result<DiskTier> {
        std::fs::create_dir_all(&config.dir)?;
        remove_folders_of_stopped_processes(&config.dir);
        let dir = config.dir.join(format!("{FOLDER_PREFIX}{}-{}", std::process::id(), NEXT_TIER.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(&dir)?;
        let (jobs, queued) = channel::<Job>();
        let (finished, reads) = channel();
        let folder = dir.clone();
        // One thread does every job in the order queued, so a read queued
        // after a write finds the file whole, and a removal after a write
        // removes it.
        let thread = std::thread::Builder::new().name("tether-kv-disk".into()).spawn(move || {
            for job in queued {
                match job {
                    Job::Write { id, file } => {
                        if let Err(e) = write_whole(&file_path(&folder, id), &file) {
                            // Its read will fail and be a miss: the turn recomputes.
                            eprintln!("warning: writing KV file {id} failed: {e}");
                        }
                    }
                    Job::Remove { id } => {
                        let _ = std::fs::remove_file(file_path(&folder, id));
                    }
                    Job::Read { id } => {
                        let bytes = std::fs::read(file_path(&folder, id))
                            .and_then(|bytes| kv_file::check(&bytes).map(|()| bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)));
                        if finished.send((id, bytes)).is_err() {
                            return;
                        }
                    }
                }
            }
        })?;
        Ok(DiskTier { dir, budget_bytes: config.budget_bytes, jobs: Some(jobs), reads, thread: Some(thread), read_ahead: HashMap::new() })
    }

    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    /// Queues `file` to be written as `id`'s.
    pub fn write(&mut self, id: FileId, file: Encoded) {
        self.send(Job::Write { id, file });
    }

    /// Queues `id`'s file for removal (after anything queued before).
    pub fn remove(&mut self, id: FileId) {
        self.read_ahead.remove(&id);
        self.send(Job::Remove { id });
    }

    /// Starts reading `id`'s file, so a [`read`](Self::read) soon after
    /// finds it in memory.
    pub fn prefetch(&mut self, id: FileId) {
        if let std::collections::hash_map::Entry::Vacant(slot) = self.read_ahead.entry(id) {
            slot.insert(None);
            self.send(Job::Read { id });
        }
    }

    /// `id`'s file's bytes, checked whole: read ahead, or read now (after
    /// its write). A missing or damaged file is an error.
    pub fn read(&mut self, id: FileId) -> std::io::Result<Vec<u8>> {
        self.prefetch(id);
        loop {
            if let Some(Some(_)) = self.read_ahead.get(&id) {
                return self.read_ahead.remove(&id).flatten().expect("matched above");
            }
            let (done, bytes) = self.reads.recv().map_err(|_| std::io::Error::other("the disk tier's thread stopped"))?;
            if let Some(slot) = self.read_ahead.get_mut(&done) {
                *slot = Some(bytes);
            }
        }
    }

    fn send(&mut self, job: Job) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
    }

    /// This tier's own folder.
    #[cfg(test)]
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn file_path(dir: &Path, id: FileId) -> PathBuf {
    dir.join(format!("{id}.kv"))
}

/// Writes under a temporary name and renames, so a file that exists is whole.
fn write_whole(path: &Path, file: &Encoded) -> std::io::Result<()> {
    let partial = path.with_extension("partial");
    let write = || -> std::io::Result<()> {
        let mut out = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(&partial)?);
        file.write_to(&mut out)?;
        // On disk before the tier's next job: left to the kernel, the
        // writeback of many spilled files comes in bursts that stall a
        // returning session's read behind them.
        out.into_inner().map_err(std::io::IntoInnerError::into_error)?.sync_data()?;
        std::fs::rename(&partial, path)
    };
    let written = write();
    if written.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    written
}

/// Removes the folders that tiers of processes no longer running left in
/// `dir` (a crash or a kill skips their own cleanup).
fn remove_folders_of_stopped_processes(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.strip_prefix(FOLDER_PREFIX)).and_then(|rest| rest.split('-').next()) else { continue };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tier(budget: usize) -> (tempdir::Dir, DiskTier) {
        let root = tempdir::Dir::new();
        let tier = DiskTier::new(&DiskTierConfig { dir: root.path.clone(), budget_bytes: budget }).unwrap();
        (root, tier)
    }

    mod tempdir {
        pub struct Dir {
            pub path: std::path::PathBuf,
        }
        impl Dir {
            pub fn new() -> Dir {
                let path = std::env::temp_dir().join(format!("tether-disk-tier-test-{}-{:?}", std::process::id(), std::thread::current().id()));
                let _ = std::fs::remove_dir_all(&path);
                std::fs::create_dir_all(&path).unwrap();
                Dir { path }
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.path);
            }
        }
    }

    /// A small KV file whose values are `salt`, and its bytes.
    fn file(salt: f32) -> (Encoded, Vec<u8>) {
        let a = mlx::Array::full(&[1, 1, 3, 4], salt, mlx::Dtype::F32).unwrap();
        let mut cache = crate::models::KvCache::new(1, 1, 4, mlx::Dtype::F32);
        cache.fill(&[(a.clone(), a)], 3, 0).unwrap();
        let file = kv_file::encode(&cache, 1, &[1, 2, 3], 0).unwrap();
        let mut bytes = Vec::new();
        file.write_to(&mut bytes).unwrap();
        (file, bytes)
    }

    #[test]
    fn written_files_read_back_and_go_when_removed() {
        let (_root, mut tier) = tier(1 << 20);
        let ((one, one_bytes), (two, two_bytes)) = (file(1.0), file(2.0));
        tier.write(1, one);
        tier.write(2, two);
        assert_eq!(tier.read(1).unwrap(), one_bytes);
        tier.prefetch(2);
        assert_eq!(tier.read(2).unwrap(), two_bytes);
        tier.remove(1);
        assert!(tier.read(1).is_err(), "a removed file is a miss");
        let dir = tier.dir().to_path_buf();
        assert!(dir.join("2.kv").exists());
        drop(tier);
        assert!(!dir.exists(), "the tier's folder goes with the engine");
    }

    #[test]
    fn missing_or_damaged_files_are_errors_not_hangs() {
        let (_root, mut tier) = tier(1 << 20);
        tier.write(7, file(1.0).0);
        tier.write(8, file(2.0).0);
        assert!(tier.read(7).is_ok() && tier.read(8).is_ok());
        std::fs::remove_file(tier.dir().join("7.kv")).unwrap();
        assert!(tier.read(7).is_err());
        let damaged = tier.dir().join("8.kv");
        let mut bytes = std::fs::read(&damaged).unwrap();
        bytes[20] ^= 1;
        std::fs::write(&damaged, bytes).unwrap();
        assert_eq!(tier.read(8).unwrap_err().kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn folders_of_stopped_processes_are_removed() {
        let root = tempdir::Dir::new();
        // No process has pid 4194305 (above Linux's pid_max).
        let stale = root.path.join(format!("{FOLDER_PREFIX}4194305-0"));
        let unrelated = root.path.join("notes");
        std::fs::create_dir_all(&stale).unwrap();
        std::fs::create_dir_all(&unrelated).unwrap();
        let tier = DiskTier::new(&DiskTierConfig { dir: root.path.clone(), budget_bytes: 1 }).unwrap();
        assert!(!stale.exists());
        assert!(unrelated.exists());
        assert!(tier.dir().exists());
    }
}
