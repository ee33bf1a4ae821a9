//! A misbehaving client of firn-sampler, for the hostile-client tests. One scenario per
//! run; prints one JSON line saying what the sampler did:
//!   firn-hostile SOCKET oversized|nested|flood|slowloris|wrong-version|never-issued|
//!                       unknown-process|fd-flood|unknown-method|unknown-interface|
//!                       bootstrap-flood|disembargo|table-*
//! `closed`: the sampler closed the connection (EOF or reset) within the scenario.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::time::{Duration, Instant};

use firn_schema::firn_capnp::{batch_sink, sampler, subscription};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(sock), Some(scenario)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: firn-hostile SOCKET SCENARIO");
        std::process::exit(2);
    };
    let out = match scenario.as_str() {
        "oversized" => raw(sock, &oversized()),
        "nested" => raw(sock, &nested(200)),
        "bootstrap-flood" => bootstrap_flood(sock, 1_000_000),
        "disembargo" => raw(sock, &disembargo()),
        _ => rpc(sock, scenario),
    };
    println!("{out}");
}

/// Reads until EOF or reset (closed) or `limit` passes (still open).
fn closed_within(s: &mut UnixStream, limit: Duration) -> bool {
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        let left = limit.saturating_sub(t0.elapsed());
        if left.is_zero() {
            return false;
        }
        let _ = s.set_read_timeout(Some(left));
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

fn raw(sock: &str, bytes: &[u8]) -> String {
    let mut s = UnixStream::connect(sock).expect("connect");
    // The sampler may close mid-write: that is an answer, not an error.
    let wrote = s.write_all(bytes).is_ok();
    let closed = closed_within(&mut s, Duration::from_secs(10));
    format!("{{\"closed\":{closed},\"wrote_all\":{wrote}}}")
}

/// `n` Bootstrap messages with fresh question ids, written as fast as the socket takes
/// them, never reading an answer (capnp-rpc answers each itself and keeps the answer
/// until a Finish).
fn bootstrap_flood(sock: &str, n: u32) -> String {
    use capnp_rpc::rpc_capnp::message;
    let mut s = UnixStream::connect(sock).expect("connect");
    let _ = s.set_write_timeout(Some(Duration::from_secs(10)));
    let mut sent = 0u32;
    let mut buf = Vec::with_capacity(64 << 10);
    'outer: while sent < n {
        buf.clear();
        for _ in 0..1024 {
            let mut b = capnp::message::Builder::new_default();
            b.init_root::<message::Builder>()
                .init_bootstrap()
                .set_question_id(sent);
            buf.extend_from_slice(&capnp::serialize::write_message_to_words(&b));
            sent += 1;
            if sent == n {
                break;
            }
        }
        if s.write_all(&buf).is_err() {
            break 'outer;
        }
    }
    let closed = closed_within(&mut s, Duration::from_secs(10));
    format!("{{\"closed\":{closed},\"sent\":{sent}}}")
}

/// A Bootstrap, then a Disembargo: a message kind only a three-party or embargoed
/// network sends, never firn's enricher.
fn disembargo() -> Vec<u8> {
    use capnp_rpc::rpc_capnp::message;
    let mut b = capnp::message::Builder::new_default();
    b.init_root::<message::Builder>()
        .init_bootstrap()
        .set_question_id(0);
    let mut out = capnp::serialize::write_message_to_words(&b);
    let mut b = capnp::message::Builder::new_default();
    let mut d = b.init_root::<message::Builder>().init_disembargo();
    d.reborrow().init_target().set_imported_cap(0);
    d.init_context().set_sender_loopback(1);
    out.extend_from_slice(&capnp::serialize::write_message_to_words(&b));
    out
}

/// A segment table announcing one 64 MiB segment (far over the sampler's limit), then
/// 8 MiB of it.
fn oversized() -> Vec<u8> {
    let words: u32 = 8 << 20;
    let mut v = Vec::with_capacity(8 + (8 << 20));
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&words.to_le_bytes());
    v.resize(8 + (8 << 20), 0);
    v
}

/// A well-formed message nested `depth` deep: each level an rpc `Message` whose union
/// says `unimplemented` and points at the next level. Far past the sampler's nesting
/// limit (8); whichever check meets it first, the connection must end.
fn nested(depth: u32) -> Vec<u8> {
    let struct_ptr: u64 = (1 << 32) | (1 << 48); // offset 0, 1 data word, 1 pointer
    let mut words = vec![struct_ptr]; // the root
    for i in 0..depth {
        words.push(0); // data: discriminant 0 = unimplemented
        words.push(if i + 1 < depth { struct_ptr } else { 0 });
    }
    let mut v = Vec::new();
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&(words.len() as u32).to_le_bytes());
    for w in words {
        v.extend_from_slice(&w.to_le_bytes());
    }
    v
}

/// Receives batches and remembers the first process with a mapping.
struct Sink {
    target: Rc<RefCell<Option<(u64, u32)>>>,
}

impl Sink {
    fn records(
        &self,
        procs: capnp::Result<
            capnp::struct_list::Reader<'_, firn_schema::firn_capnp::process::Owned>,
        >,
    ) {
        for p in procs.into_iter().flatten() {
            let has_file = p.get_mappings().is_ok_and(|m| !m.is_empty());
            if has_file && self.target.borrow().is_none() {
                *self.target.borrow_mut() = Some((p.get_process_id(), p.get_mappings_version()));
            }
        }
    }
}

impl batch_sink::Server for Sink {
    fn push(
        self: Rc<Self>,
        params: batch_sink::PushParams,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        if let Ok(b) = params.get().and_then(|p| p.get_batch()) {
            self.records(b.get_processes());
        }
        std::future::ready(Ok(()))
    }

    fn announce(
        self: Rc<Self>,
        params: batch_sink::AnnounceParams,
    ) -> impl std::future::Future<Output = Result<(), capnp::Error>> + 'static {
        if let Ok(p) = params.get() {
            self.records(p.get_processes());
        }
        std::future::ready(Ok(()))
    }
}

fn rpc(sock: &str, scenario: &str) -> String {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&rt, scenario_rpc(sock.to_string(), scenario.to_string()))
}

async fn scenario_rpc(sock: String, scenario: String) -> String {
    let firn_tests::liar::Session {
        client,
        ended: ended_rx,
    } = firn_tests::liar::connect(&sock).await;
    let ended = async move {
        let _ = ended_rx.await;
    };
    let info = |v: u32| {
        let mut req = client.info_request();
        req.get().set_protocol_version(v);
        req
    };
    let target = Rc::new(RefCell::new(None));
    let mut errors = 0u64;
    let mut answered = 0u64;
    match scenario.as_str() {
        "wrong-version" => {
            if info(99).send().promise.await.is_err() {
                errors += 1;
            }
        }
        "unknown-method" | "unknown-interface" => {
            // A method past the schema's on the bootstrap interface, or an interface the
            // sampler does not export at all.
            let (iface, method) = if scenario == "unknown-method" {
                (<sampler::Client as capnp::traits::HasTypeId>::TYPE_ID, 9)
            } else {
                (0x1234_5678_9abc_def0, 0)
            };
            let call = client
                .client
                .new_call::<capnp::any_pointer::Owned, capnp::any_pointer::Owned>(
                    iface, method, None,
                );
            if call.send().promise.await.is_err() {
                errors += 1;
            }
        }
        "flood" => {
            // Far more calls than the per-connection budget, all in flight at once.
            let calls: Vec<_> = (0..20_000)
                .map(|_| info(firn_schema::PROTOCOL_VERSION).send().promise)
                .collect();
            for c in futures::future::join_all(calls).await {
                if c.is_ok() {
                    answered += 1
                } else {
                    errors += 1
                }
            }
        }
        "slowloris" => {
            // Never reads: calls below the rate limit whose answers pile up unread.
            drop(client);
            return slowloris(&sock).await;
        }
        "never-issued" | "unknown-process" | "fd-flood" | "table-unsorted" | "table-bad-kind"
        | "table-oversized" | "table-unknown" | "table-never-issued" | "table-flood"
        | "table-spread" => {
            let sink: batch_sink::Client = capnp_rpc::new_client(Sink {
                target: target.clone(),
            });
            let mut req = client.subscribe_request();
            req.get()
                .set_protocol_version(firn_schema::PROTOCOL_VERSION);
            req.get().set_sink(sink);
            let res = req.send().promise.await.expect("subscribe");
            let sub: subscription::Client = res.get().unwrap().get_subscription().unwrap();
            let t0 = Instant::now();
            while target.borrow().is_none() && t0.elapsed() < Duration::from_secs(20) {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let (pid, version) = target.borrow().unwrap_or((1, 0));
            let open = |id: u64, idx: u32, v: u32| {
                let mut r = sub.open_mapping_request();
                r.get().set_process_id(id);
                r.get().set_mapping_index(idx);
                r.get().set_mappings_version(v);
                r.send().promise
            };
            let table = |id: u64, v: u32, first: u32, total: u32, rows: Vec<u8>| {
                let mut r = sub.load_unwind_table_request();
                r.get().set_process_id(id);
                r.get().set_mapping_index(0);
                r.get().set_mappings_version(v);
                r.get().set_first_row(first);
                r.get().set_total_rows(total);
                r.get().set_rows(&rows);
                r.send().promise
            };
            // A row: pc, CFA = rsp + 8 (valid unless changed).
            let row = |pc: u32, kinds: u8| {
                let mut b = pc.to_le_bytes().to_vec();
                b.extend_from_slice(&8u16.to_le_bytes());
                b.extend_from_slice(&[kinds, 0]);
                b
            };
            let refused = |reply: &capnp::capability::Response<
                firn_schema::firn_capnp::subscription::load_unwind_table_results::Owned,
            >| {
                matches!(
                    reply.get().and_then(|r| r.get_result()).map(|r| r.which()),
                    Ok(Ok(firn_schema::firn_capnp::table_result::Refused(_)))
                )
            };
            match scenario.as_str() {
                "table-unsorted" | "table-bad-kind" => {
                    let rows = if scenario == "table-unsorted" {
                        [row(0x20, 1), row(0x10, 1)].concat()
                    } else {
                        [row(0x10, 1), row(0x20, 9)].concat()
                    };
                    if table(pid, version, 0, 2, rows).await.is_err() {
                        errors += 1;
                    }
                }
                "table-oversized" | "table-unknown" => {
                    // Over the per-table limit (refused, connection kept), or a version
                    // this subscription was never sent (refused, kept).
                    let (v, total) = if scenario == "table-oversized" {
                        (version, 64 << 20)
                    } else {
                        (version.wrapping_add(7), 1)
                    };
                    for _ in 0..5 {
                        match table(pid, v, 0, total, row(0x10, 1)).await {
                            Ok(r) if refused(&r) => answered += 1,
                            _ => errors += 1,
                        }
                    }
                }
                "table-spread" => {
                    // Well-formed rows spread over the whole 4 GiB of offsets, one per
                    // 256 KiB: the sampler's page directory must stay within its room
                    // (pages grow instead), and the table is taken.
                    let rows: Vec<u8> = (0..16_384u32).flat_map(|i| row(i << 18, 1)).collect();
                    match table(pid, version, 0, 16_384, rows).await {
                        Ok(r) if !refused(&r) => answered += 1,
                        _ => errors += 1,
                    }
                    // Held for a few rounds, so the pool's gauge shows it.
                    tokio::time::sleep(Duration::from_millis(2500)).await;
                }
                "table-never-issued" => {
                    if table(pid + 1_000_000, version, 0, 1, row(0x10, 1))
                        .await
                        .is_err()
                    {
                        errors += 1;
                    }
                }
                "table-flood" => {
                    let calls: Vec<_> = (0..3_000)
                        .map(|_| table(pid, version, 0, 1, row(0x10, 1)))
                        .collect();
                    for c in futures::future::join_all(calls).await {
                        if c.is_ok() {
                            answered += 1
                        } else {
                            errors += 1
                        }
                    }
                }
                "never-issued" => {
                    if open(pid + 1_000_000, 0, version).await.is_err() {
                        errors += 1;
                    }
                }
                "unknown-process" => {
                    // Issued ids, wrong version: refused, not a reason to disconnect.
                    for _ in 0..10 {
                        match open(pid, 0, version.wrapping_add(7)).await {
                            Ok(_) => answered += 1,
                            Err(_) => errors += 1,
                        }
                    }
                }
                _ => {
                    // No broker channel is attached: every open is refused, past the
                    // broker's rate limit as fast as the sampler answers.
                    let calls: Vec<_> = (0..3_000).map(|_| open(pid, 0, version)).collect();
                    for c in futures::future::join_all(calls).await {
                        if c.is_ok() {
                            answered += 1
                        } else {
                            errors += 1
                        }
                    }
                }
            }
        }
        other => {
            eprintln!("unknown scenario {other}");
            std::process::exit(2);
        }
    }
    let closed = tokio::time::timeout(Duration::from_secs(10), ended)
        .await
        .is_ok();
    format!("{{\"closed\":{closed},\"errors\":{errors},\"answered\":{answered}}}")
}

/// Sends the bytes of `info` calls, four a second, and never reads an answer.
async fn slowloris(sock: &str) -> String {
    let mut s = UnixStream::connect(sock).expect("connect");
    let calls = info_calls(400);
    let t0 = Instant::now();
    let mut sent = 0;
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    for c in &calls {
        if s.write_all(c).is_err() {
            break;
        }
        sent += 1;
        // Closed by the sampler? A zero-byte peek says so without reading answers.
        let mut b = [0u8; 1];
        let _ = s.set_nonblocking(true);
        let gone = matches!(
            nix::sys::socket::recv(
                std::os::fd::AsRawFd::as_raw_fd(&s),
                &mut b,
                nix::sys::socket::MsgFlags::MSG_PEEK
            ),
            Ok(0)
        );
        let _ = s.set_nonblocking(false);
        if gone || t0.elapsed() > Duration::from_secs(90) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // Drain now: EOF (after the unread answers) means the sampler closed it.
    let closed = closed_within(&mut s, Duration::from_secs(15));
    format!(
        "{{\"closed\":{closed},\"calls_sent\":{sent},\"seconds\":{}}}",
        t0.elapsed().as_secs()
    )
}

/// Raw RPC messages: a bootstrap, then `n` info calls on its answer.
fn info_calls(n: u32) -> Vec<Vec<u8>> {
    use capnp_rpc::rpc_capnp::message;
    let mut out = Vec::new();
    let mut b = capnp::message::Builder::new_default();
    b.init_root::<message::Builder>()
        .init_bootstrap()
        .set_question_id(0);
    out.push(capnp::serialize::write_message_to_words(&b));
    for q in 1..=n {
        let mut b = capnp::message::Builder::new_default();
        let mut call = b.init_root::<message::Builder>().init_call();
        call.set_question_id(q);
        call.set_interface_id(<sampler::Client as capnp::traits::HasTypeId>::TYPE_ID);
        call.set_method_id(0);
        call.reborrow()
            .init_target()
            .init_promised_answer()
            .set_question_id(0);
        let mut params = call
            .init_params()
            .init_content()
            .init_as::<sampler::info_params::Builder>();
        params.set_protocol_version(firn_schema::PROTOCOL_VERSION);
        out.push(capnp::serialize::write_message_to_words(&b));
    }
    out
}
