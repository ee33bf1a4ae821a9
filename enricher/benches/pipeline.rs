//! The enricher's per-round path, per stage: decode (the batch message through the
//! reader limits and validation), symbolize (cold with DWARF, cold from the symbol
//! tables only as over `--symbol-budget`, and from the frame cache),
//! aggregate into pprof + gzip encode, at 1k / 10k / 100k unique stacks.
//!
//! Input: stacks made of real function addresses of a real binary (this benchmark's own
//! executable, a few MiB of Rust with DWARF), drawn with a fixed seed, 16–40 frames deep
//! and several samples each, the shape of what a busy node sends in a round. The binary
//! is opened directly (the benchmark plays the broker). Throughput is samples per
//! second on one core (the enricher is single-threaded).
//!
//! Run: `cargo bench -p firn-enricher --bench pipeline`.

use std::ops::ControlFlow;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use blazesym::inspect::source::{Elf as InspectElf, Source as InspectSource};
use blazesym::inspect::Inspector;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use firn_enricher::Metrics;
use firn_enricher::{encode_gz, Frame, MappingSpec, PprofBuilder as Builder, StackSample};
use firn_enricher::{BinaryId, SymbolLimits as Limits, Symbolizer};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn function_offsets(path: &std::path::Path) -> Vec<u64> {
    let inspector = Inspector::new();
    let src = InspectSource::Elf(InspectElf::new(path));
    let mut offs = Vec::new();
    let _ = inspector.for_each(&src, |sym| {
        if let (Some(off), Some(size)) = (sym.file_offset, sym.size) {
            if size > 8 {
                offs.push(off + (size as u64) / 2);
            }
        }
        ControlFlow::Continue(())
    });
    offs.sort_unstable();
    offs.dedup();
    offs
}

fn open(path: &std::path::Path) -> OwnedFd {
    std::fs::File::open(path)
        .expect("open own executable")
        .into()
}

/// `n` unique stacks of file offsets.
fn stacks(funcs: &[u64], n: usize) -> Vec<Vec<u64>> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    (0..n)
        .map(|_| {
            let depth = 16 + (rng.next() % 25) as usize;
            (0..depth)
                .map(|_| funcs[(rng.next() as usize) % funcs.len()])
                .collect()
        })
        .collect()
}

const SAMPLES_PER_STACK: u64 = 4;

fn bench(c: &mut Criterion) {
    let exe = std::env::current_exe().expect("current_exe");
    let funcs = function_offsets(&exe);
    assert!(funcs.len() > 1000, "too few functions in {}", exe.display());
    let metrics = Arc::new(Metrics::default());
    let mapping = Arc::new(MappingSpec {
        start: 0x5555_0000_0000,
        limit: 0x5555_1000_0000,
        offset: 0,
        file: Arc::from(exe.to_string_lossy().as_ref()),
        build_id: Arc::from("00"),
        symbolized: true,
    });
    let labels = Arc::new(vec![("pid".to_string(), "1".to_string())]);

    for &n in &[1_000usize, 10_000, 100_000] {
        let st = stacks(&funcs, n);
        let mut offsets: Vec<u64> = st.iter().flatten().copied().collect();
        offsets.sort_unstable();
        offsets.dedup();
        let samples = n as u64 * SAMPLES_PER_STACK;
        let mut g = c.benchmark_group(format!("round_{n}_stacks"));
        g.sample_size(10);
        g.throughput(Throughput::Elements(samples));

        // A batch holds at most MAX_SAMPLES entries (the BPF counts map's size): a
        // larger round is not a message the enricher can receive.
        if n <= firn_schema::limits::MAX_SAMPLES as usize {
            let wire = batch_message(&st, mapping.start);
            g.bench_function(BenchmarkId::new("decode", n), |b| {
                b.iter(|| {
                    let msg = capnp::serialize::read_message_from_flat_slice(
                        &mut &wire[..],
                        firn_schema::enricher_reader_options(),
                    )
                    .expect("read");
                    let root = msg
                        .get_root::<firn_schema::firn_capnp::batch::Reader>()
                        .expect("root");
                    firn_enricher::decode_batch(root)
                        .expect("decode")
                        .samples
                        .len()
                })
            });
        }

        // Cold: a fresh symbolizer per iteration. With DWARF (a budget that holds this
        // binary's debug info: names, file:line, inline frames) and from the symbol
        // tables only (a budget it exceeds: names only), as `--symbol-budget`
        // decides per binary.
        for (stage, budget_bytes) in [("cold_dwarf", u64::MAX), ("cold_symtab", 0)] {
            let limits = Limits {
                binaries: 4,
                budget_bytes,
                frames: offsets.len(),
            };
            g.bench_function(BenchmarkId::new("symbolize", stage), |b| {
                b.iter(|| {
                    let mut s = Symbolizer::new(limits, metrics.clone());
                    let id = s.load(open(&exe)).expect("load");
                    s.symbolize(&id, &offsets).len()
                })
            });
            let mut s = Symbolizer::new(limits, metrics.clone());
            let id = s.load(open(&exe)).expect("load");
            let named = s.symbolize(&id, &offsets);
            let lines: usize = named.iter().flatten().map(|l| l.len()).sum();
            eprintln!(
                "symbolize/{stage}: {} of {} offsets named, {lines} lines (inline included), symbols held {} MiB",
                named.iter().flatten().count(),
                offsets.len(),
                s.bytes_held() >> 20
            );
        }

        let limits = Limits {
            binaries: 4,
            budget_bytes: u64::MAX,
            frames: offsets.len(),
        };
        let mut warm = Symbolizer::new(limits, metrics.clone());
        let id: BinaryId = warm.load(open(&exe)).expect("load");
        let resolved = warm.symbolize(&id, &offsets);
        g.bench_function(BenchmarkId::new("symbolize", "cached"), |b| {
            b.iter(|| warm.symbolize(&id, &offsets).len())
        });

        let lines: std::collections::HashMap<u64, _> = offsets
            .iter()
            .copied()
            .zip(resolved.iter().cloned())
            .collect();
        let stack_samples: Vec<StackSample> = st
            .iter()
            .map(|frames| StackSample {
                process_id: 1,
                labels: labels.clone(),
                frames: frames
                    .iter()
                    .map(|o| Frame::User {
                        mapping: Some(mapping.clone()),
                        address: mapping.start + o,
                        lines: lines.get(o).cloned().flatten(),
                    })
                    .collect::<Vec<_>>()
                    .into(),
                count: SAMPLES_PER_STACK,
                off_cpu_ns: 0,
            })
            .collect();
        g.bench_function(BenchmarkId::new("aggregate_encode_gzip", n), |b| {
            b.iter(|| {
                let mut builder = Builder::new(19, 0, 10_000_000_000);
                for s in &stack_samples {
                    builder.add(s);
                }
                encode_gz(&builder.finish()).map(|v| v.len()).unwrap_or(0)
            })
        });
        // The upload sinks' extra work per round: the OTLP request (its own encoding
        // and dictionary) and Parca's WriteRaw (which wraps the pprof above).
        let round = firn_enricher::Round {
            session_id: 1,
            round: 1,
            start_ns: 0,
            end_ns: 10_000_000_000,
            frequency_hz: 19,
            off_cpu: false,
            stacks: stack_samples.clone(),
        };
        let groups = firn_enricher::encodings::groups(&round, firn_enricher::ProfileBy::Process);
        g.bench_function(BenchmarkId::new("upload_otlp_encode", n), |b| {
            b.iter(|| firn_enricher::encodings::otlp(&round, &groups).map_or(0, |v| v.len()))
        });
        let encoded = firn_enricher::encodings::per_label_set(&round, &groups);
        g.bench_function(BenchmarkId::new("upload_parca_encode", n), |b| {
            b.iter(|| {
                firn_enricher::encodings::parca(&round, &groups, &encoded).map_or(0, |v| v.len())
            })
        });
        let layout = firn_enricher::encodings::RoundLayout::new(&round, &groups);
        let format = firn_enricher::encodings::OpenSearchFormat {
            index_prefix: "firn-profiles".into(),
            max_stacks: 2_000,
            max_bytes: 4 << 20,
            pprof_base: "http://127.0.0.1:7071".into(),
        };
        g.bench_function(BenchmarkId::new("upload_opensearch_encode", n), |b| {
            b.iter(|| {
                firn_enricher::encodings::opensearch(&round, &groups, &layout, &format)
                    .map_or(0, |(v, _)| v.len())
            })
        });
        let (os_bytes, os_enc) =
            firn_enricher::encodings::opensearch(&round, &groups, &layout, &format)
                .unwrap_or_default();
        println!(
            "round of {n} stacks: OpenSearch _bulk {} bytes, {} profile and {} stack documents, {} stacks left out",
            os_bytes.len(),
            os_enc.profiles,
            os_enc.stacks,
            os_enc.stacks_left_out
        );
        // The web view's query over the window at its bound: 20,000 stacks (the 10k
        // round twice, as two rounds).
        if n == 10_000 {
            let q = firn_enricher::encodings::ViewQuery::parse(&Default::default())
                .expect("default query");
            let rounds: Vec<_> = (0..2u64)
                .map(|i| {
                    std::sync::Arc::new(firn_enricher::Round {
                        session_id: 1,
                        round: i + 1,
                        start_ns: i * 10_000_000_000,
                        end_ns: (i + 1) * 10_000_000_000,
                        frequency_hz: 19,
                        off_cpu: false,
                        stacks: stack_samples.clone(),
                    })
                })
                .collect();
            let json = |r: &[std::sync::Arc<firn_enricher::Round>]| {
                let v = firn_enricher::encodings::view(r, &q, 0, 20_000_000_000, false);
                serde_json::to_vec(&v).map_or(0, |j| j.len())
            };
            let v = firn_enricher::encodings::view(&rounds, &q, 0, 20_000_000_000, false);
            println!(
                "view of 20,000 stacks: {} bytes of JSON, {} stacks cut short at the node bound, {} nodes folded",
                json(&rounds),
                v.cut_short,
                v.folded_nodes
            );
            g.bench_function(BenchmarkId::new("view_build_json", 20_000), |b| {
                b.iter(|| json(&rounds))
            });
        }
        let otlp = firn_enricher::encodings::otlp(&round, &groups).map_or(0, |v| v.len());
        let pprof = encoded.iter().map(|e| e.gz.len()).sum::<usize>();
        println!("round of {n} stacks: OTLP request {otlp} bytes, gzip pprof {pprof} bytes");
        g.finish();
    }
}

/// A batch as the sampler sends it: one sample entry per stack, user frames only.
fn batch_message(stacks: &[Vec<u64>], base: u64) -> Vec<u8> {
    let mut m = capnp::message::Builder::new_default();
    let mut b = m.init_root::<firn_schema::firn_capnp::batch::Builder>();
    b.set_round(1);
    b.set_frequency_hz(19);
    let mut list = b.init_samples(stacks.len() as u32);
    for (i, st) in stacks.iter().enumerate() {
        let mut s = list.reborrow().get(i as u32);
        s.set_process_id(1);
        s.set_pid(1);
        s.set_tid(1);
        s.set_comm(b"bench");
        s.set_count(SAMPLES_PER_STACK);
        let mut f = s.init_user_frames(st.len() as u32);
        for (j, o) in st.iter().enumerate() {
            f.set(j as u32, base + o);
        }
    }
    capnp::serialize::write_message_to_words(&m)
}

criterion_group!(benches, bench);
criterion_main!(benches);
