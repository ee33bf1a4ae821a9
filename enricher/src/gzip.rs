//! gzip (RFC 1952) with one deflate state per thread, reset between members.
//!
//! A new deflate state allocates and zeroes ~300 KiB of tables: about 100 µs in a
//! warm loop, several times the compression of a round's small profile (a 2 KB one:
//! 122 µs fresh against 24 µs reused), and more in the enricher, whose heap gives freed
//! memory back (heap.rs), so that each new state is also ~75 fresh pages. So each
//! thread that encodes keeps one: the event loop for the profiles it writes, and the
//! view's blocking threads for the downloads they build, while they live (tokio ends an
//! idle one after 10 s, and its state with it).
//!
//! flate2's `GzEncoder` cannot be reset, so the ten-byte header and eight-byte trailer
//! are written here around flate2's raw deflate stream: `GzEncoder`'s header and
//! trailer (with `Compression::fast()`), and for an input compressed in one call its
//! very bytes.

use std::cell::RefCell;

use flate2::{Compress, Compression, Crc, FlushCompress, Status};

/// Magic, deflate, no flags, no modification time, "fastest" (for `Compression::fast`),
/// operating system unknown: `GzBuilder`'s defaults.
const HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 4, 0xff];

thread_local! {
    static DEFLATE: RefCell<Option<Compress>> = const { RefCell::new(None) };
}

/// `data` as one gzip member.
pub(crate) fn compress(data: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(HEADER.len() + data.len() / 3 + 64);
    out.extend_from_slice(&HEADER);
    DEFLATE.with_borrow_mut(|slot| {
        let deflate = slot.get_or_insert_with(|| Compress::new(Compression::fast(), false));
        // A member left unfinished by an error is dropped here too.
        deflate.reset();
        loop {
            let consumed = usize::try_from(deflate.total_in()).unwrap_or(data.len());
            let rest = data.get(consumed..).unwrap_or_default();
            // compress_vec writes only into spare capacity.
            out.reserve(rest.len() / 2 + 64);
            match deflate.compress_vec(rest, &mut out, FlushCompress::Finish) {
                Ok(Status::StreamEnd) => return Ok(()),
                Ok(Status::Ok | Status::BufError) => {}
                Err(e) => return Err(std::io::Error::other(e)),
            }
        }
    })?;
    let mut crc = Crc::new();
    crc.update(data);
    out.extend_from_slice(&crc.sum().to_le_bytes());
    // ISIZE is the length modulo 2^32.
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};

    use super::*;

    fn flate2_gzip(data: &[u8]) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), Compression::fast());
        gz.write_all(data).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn members_read_back_and_match_flate2s() {
        // Empty, tiny, and larger than any one output reservation (which flate2's writer
        // feeds in chunks, so its blocks differ); twice each, so the reused state is
        // reset between members.
        let big: Vec<u8> = (0..300_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for data in [&b""[..], b"pprof", &big[..], b"pprof", &big[..]] {
            let ours = compress(data).unwrap();
            let theirs = flate2_gzip(data);
            assert_eq!(ours[..10], theirs[..10], "header");
            assert_eq!(
                ours[ours.len() - 8..],
                theirs[theirs.len() - 8..],
                "trailer"
            );
            if data.len() < 1000 {
                assert_eq!(ours, theirs, "{} bytes", data.len());
            }
            let mut back = Vec::new();
            flate2::read::GzDecoder::new(&ours[..])
                .read_to_end(&mut back)
                .unwrap();
            assert_eq!(back, data);
        }
    }
}
