//! The kernel's CPU lists (online, possible) and which online CPU is not sampled.

/// Entries for an array indexed by CPU number: one past the highest possible CPU.
pub(crate) fn possible_cpus() -> std::io::Result<u32> {
    let text = read_sysfs("/sys/devices/system/cpu/possible")?;
    parse_cpu_list(&text)
        .and_then(|cpus| cpus.into_iter().max())
        .and_then(|max| max.checked_add(1))
        .ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("unexpected CPU list {text:?}"),
            )
        })
}

const ONLINE: &str = "/sys/devices/system/cpu/online";

#[cfg(test)]
fn online_cpus() -> std::io::Result<Vec<u32>> {
    cpu_list(read_sysfs(ONLINE)?)
}

fn cpu_list(text: String) -> std::io::Result<Vec<u32>> {
    parse_cpu_list(&text).ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("unexpected CPU list {text:?}"),
        )
    })
}

/// The online CPU list, opened once at setup and read again each round from its start
/// (sysfs makes the text anew for a read at offset 0): one call a round where an open
/// by path (a walk of five sysfs names), a read and a close were three.
pub(crate) struct OnlineCpus {
    file: std::fs::File,
    buf: Vec<u8>,
}

impl OnlineCpus {
    pub(crate) fn open() -> std::io::Result<Self> {
        Ok(Self {
            file: std::fs::File::open(ONLINE)?,
            // A sysfs attribute's text is at most a page (64 KiB on the largest pages);
            // pages of the buffer never written stay out of RSS.
            buf: vec![0; 1 << 16],
        })
    }

    pub(crate) fn read(&mut self) -> std::io::Result<Vec<u32>> {
        let n = nix::sys::uio::pread(&self.file, &mut self.buf, 0).map_err(std::io::Error::from)?;
        // A read that fills the buffer may be cut, and the filter allows no other
        // offset to read on from.
        if n == self.buf.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "the online CPU list is longer than 64 KiB",
            ));
        }
        cpu_list(text(self.buf[..n].to_vec())?)
    }
}

/// A small sysfs file in one read (sysfs hands its whole text to the first read): open,
/// read, close, where `read_to_string` adds a stat and a read that returns nothing.
fn read_sysfs(path: &str) -> std::io::Result<String> {
    let f = std::fs::File::open(path)?;
    text(crate::procfs::read_short(&f, 1 << 16).map_err(std::io::Error::from)?)
}

fn text(bytes: Vec<u8>) -> std::io::Result<String> {
    String::from_utf8(bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// An online CPU the program does not sample: one that came online after setup, or an
/// attached one that was seen offline since (`gone`). Taking a CPU offline ends its
/// perf event for good, and a confined sampler cannot open a new one. (Sample counts
/// cannot tell: an idle CPU may take no sample for whole rounds.)
pub(crate) fn unsampled_cpu(attached: &[u32], online: &[u32], gone: &[u32]) -> Option<u32> {
    online
        .iter()
        .copied()
        .find(|cpu| !attached.contains(cpu) || gone.contains(cpu))
}

/// Parses the kernel's CPU list format, e.g. `0-3,5,7-8`.
fn parse_cpu_list(text: &str) -> Option<Vec<u32>> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (u32, u32) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 65_536 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_sysfs_file_in_one_read_reads_as_a_whole() {
        let path = "/sys/devices/system/cpu/online";
        let whole = std::fs::read_to_string(path).expect("the online CPU list");
        assert_eq!(super::read_sysfs(path).expect("read"), whole);
        // A longer text, in seq_file's records: read on until the end.
        let status = super::read_sysfs("/proc/self/status").expect("status");
        assert!(
            status.len() > 256 && status.starts_with("Name:"),
            "{status}"
        );
        assert!(status.contains("\nThreads:"), "{status}");
        assert!(super::read_sysfs("/sys/no/such/file").is_err());
    }

    /// The kept file reads the whole list, again and again, as a fresh open does.
    #[test]
    fn the_kept_online_list_reads_as_a_fresh_open() {
        let mut kept = super::OnlineCpus::open().expect("open");
        let fresh = super::online_cpus().expect("online");
        assert!(!fresh.is_empty());
        for _ in 0..3 {
            assert_eq!(kept.read().expect("read"), fresh);
        }
    }

    #[test]
    fn a_cpu_back_from_offline_is_noticed() {
        use super::unsampled_cpu as u;
        assert_eq!(u(&[0, 1], &[0, 1], &[]), None);
        assert_eq!(u(&[0, 1], &[0], &[1]), None, "offline: nothing to do yet");
        assert_eq!(u(&[0, 1], &[0, 1], &[1]), Some(1), "back from offline");
        assert_eq!(u(&[0], &[0, 1], &[]), Some(1), "online after setup");
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(super::parse_cpu_list("0-1\n"), Some(vec![0, 1]));
        assert_eq!(super::parse_cpu_list("0,2-3,5"), Some(vec![0, 2, 3, 5]));
        assert_eq!(super::parse_cpu_list("3-1"), None);
        // This machine's: CPU 0 is always possible, and every online CPU is.
        let possible = super::possible_cpus().expect("possible CPUs");
        let online = super::online_cpus().expect("online CPUs");
        assert!(
            online.iter().all(|&c| c < possible),
            "{online:?} {possible}"
        );
    }
}
