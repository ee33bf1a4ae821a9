//! Enricher side of the binary broker: asks the sampler for the file of a mapping by the
//! identifiers it issued, and receives the fd on the broker channel (SCM_RIGHTS).

use std::cell::RefCell;
use std::io::IoSliceMut;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use firn_schema::firn_capnp::{
    interpreter_result, open_result, subscription, table_result, InterpreterRefusal, Refusal,
    TableRefusal,
};
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use tokio::io::unix::AsyncFd;
use tokio::io::AsyncWriteExt;

/// Longest wait for an fd after the sampler granted it.
const FD_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub(crate) enum BrokerError {
    #[error("the sampler refused: {0:?}")]
    Refused(Refusal),
    #[error("broker call failed: {0}")]
    Rpc(#[from] capnp::Error),
    #[error("broker channel: {0}")]
    Channel(std::io::Error),
    #[error("no fd arrived for ticket {0}")]
    Missing(u64),
}

pub(crate) struct Broker {
    subscription: subscription::Client,
    channel: AsyncFd<UnixStream>,
    /// Serialises requests: tickets arrive in order on the one channel.
    busy: tokio::sync::Mutex<()>,
    /// Fds that arrived for tickets nobody waits for any more.
    stray: RefCell<u64>,
    /// Unwind tables sent on this subscription (they last as long as it does).
    pub(crate) tables: RefCell<crate::unwind::Sent>,
    /// Interpreter records sent on this subscription: process id → mappings version.
    pub(crate) interpreters: RefCell<std::collections::HashMap<u64, u32>>,
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum TableSendError {
    #[error("the sampler refused the table: {0:?}")]
    Refused(TableRefusal),
    #[error("table call failed: {0}")]
    Rpc(#[from] capnp::Error),
}

#[derive(Debug, thiserror::Error)]
pub(crate) enum InterpreterSendError {
    #[error("the sampler refused the interpreter: {0:?}")]
    Refused(InterpreterRefusal),
    #[error("interpreter call failed: {0}")]
    Rpc(#[from] capnp::Error),
}

impl Broker {
    /// Opens the broker channel: a second connection that presents the key.
    pub(crate) async fn connect(
        socket: &std::path::Path,
        subscription: subscription::Client,
        key: &[u8],
    ) -> Result<Self, BrokerError> {
        let mut s = tokio::net::UnixStream::connect(socket)
            .await
            .map_err(BrokerError::Channel)?;
        let mut hello = firn_schema::firn_capnp::BROKER_MAGIC.to_vec();
        hello.extend_from_slice(key);
        s.write_all(&hello).await.map_err(BrokerError::Channel)?;
        let std = s.into_std().map_err(BrokerError::Channel)?;
        Ok(Self {
            subscription,
            // SAFETY: the stream owns its fd for the AsyncFd's whole life and always
            // reports the same one.
            channel: unsafe { AsyncFd::register(std) }
                .map_err(|e| BrokerError::Channel(e.into()))?,
            busy: tokio::sync::Mutex::new(()),
            stray: RefCell::new(0),
            tables: RefCell::new(crate::unwind::Sent::default()),
            interpreters: RefCell::default(),
        })
    }

    /// Sends the unwind table (`rows`, 8 bytes each) of mapping `index` of process
    /// `process_id`, in chunks; the sampler takes it for that file in every process.
    pub(crate) async fn load_table(
        &self,
        process_id: u64,
        index: u32,
        version: u32,
        rows: &[u8],
    ) -> Result<(), TableSendError> {
        let row = firn_schema::firn_capnp::UNWIND_ROW_BYTES as usize;
        let total = u32::try_from(rows.len() / row)
            .map_err(|_| TableSendError::Refused(TableRefusal::TooLarge))?;
        let chunk = firn_schema::limits::MAX_TABLE_CHUNK_ROWS as usize * row;
        for (i, part) in rows.chunks(chunk).enumerate() {
            let mut req = self.subscription.load_unwind_table_request();
            let mut p = req.get();
            p.set_process_id(process_id);
            p.set_mapping_index(index);
            p.set_mappings_version(version);
            p.set_first_row((i * chunk / row) as u32);
            p.set_total_rows(total);
            p.set_rows(part);
            let reply = req.send().promise.await?;
            match reply
                .get()?
                .get_result()?
                .which()
                .map_err(capnp::Error::from)?
            {
                table_result::Done(()) => {}
                table_result::Refused(r) => {
                    return Err(TableSendError::Refused(
                        r.unwrap_or(TableRefusal::OutOfOrder),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Tells the sampler where process `process_id`'s CPython interpreter is: the
    /// 128-byte `record` for the file of its mapping `index`, which holds the eval loop.
    pub(crate) async fn load_interpreter(
        &self,
        process_id: u64,
        index: u32,
        version: u32,
        record: &[u8],
    ) -> Result<(), InterpreterSendError> {
        let mut req = self.subscription.load_interpreter_request();
        let mut p = req.get();
        p.set_process_id(process_id);
        p.set_mapping_index(index);
        p.set_mappings_version(version);
        p.set_record(record);
        let reply = req.send().promise.await?;
        match reply
            .get()?
            .get_result()?
            .which()
            .map_err(capnp::Error::from)?
        {
            interpreter_result::Done(()) => Ok(()),
            interpreter_result::Refused(r) => Err(InterpreterSendError::Refused(
                r.unwrap_or(InterpreterRefusal::Invalid),
            )),
        }
    }

    /// The file of mapping `index` (as of `version`) of process `process_id`.
    pub(crate) async fn open(
        &self,
        process_id: u64,
        index: u32,
        version: u32,
    ) -> Result<OwnedFd, BrokerError> {
        let _turn = self.busy.lock().await;
        let mut req = self.subscription.open_mapping_request();
        req.get().set_process_id(process_id);
        req.get().set_mapping_index(index);
        req.get().set_mappings_version(version);
        let reply = req.send().promise.await?;
        let ticket = match reply
            .get()?
            .get_result()?
            .which()
            .map_err(capnp::Error::from)?
        {
            open_result::Ticket(t) => t,
            open_result::Refused(r) => {
                return Err(BrokerError::Refused(r.unwrap_or(Refusal::OpenFailed)))
            }
        };
        tokio::time::timeout(FD_TIMEOUT, self.receive(ticket))
            .await
            .map_err(|_| BrokerError::Missing(ticket))?
    }

    async fn receive(&self, ticket: u64) -> Result<OwnedFd, BrokerError> {
        loop {
            let mut guard = self
                .channel
                .readable()
                .await
                .map_err(BrokerError::Channel)?;
            let got = guard.try_io(|inner| recv_one(inner.get_ref()));
            match got {
                Ok(Ok(Some((t, fd)))) if t == ticket => return Ok(fd),
                Ok(Ok(Some((_, fd)))) => {
                    // A late fd of an earlier, abandoned request.
                    drop(fd);
                    *self.stray.borrow_mut() += 1;
                }
                Ok(Ok(None)) => {
                    return Err(BrokerError::Channel(std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "broker channel closed",
                    )))
                }
                Ok(Err(e)) => return Err(BrokerError::Channel(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

/// One message: 16 bytes (ticket, reserved) with exactly one fd attached.
fn recv_one(s: &UnixStream) -> std::io::Result<Option<(u64, OwnedFd)>> {
    let mut buf = [0u8; 16];
    let mut iov = [IoSliceMut::new(&mut buf)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 4]);
    let msg = recvmsg::<()>(
        s.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .map_err(std::io::Error::from)?;
    let n = msg.bytes;
    let mut fds: Vec<OwnedFd> = Vec::new();
    for c in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(raw) = c {
            // SAFETY: the kernel installed these descriptors for us; we own them now.
            fds.extend(
                raw.into_iter()
                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
            );
        }
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    if n != 16 || fds.len() != 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("malformed broker message: {n} bytes, {} fds", fds.len()),
        ));
    }
    let ticket = u64::from_le_bytes(buf[..8].try_into().unwrap_or_default());
    Ok(fds.pop().map(|fd| (ticket, fd)))
}
