//! Against the interpreters on this machine: Debian's python3 (3.11, stripped, non-PIE,
//! libpython linked in) and pyenv's builds (shared libpython, PIE). With CI=true a machine
//! that has pyenv must have them all; without pyenv they are skipped with a note.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::*;

const DEBIAN: &str = "/usr/bin/python3.11";
const PYENV: [&str; 4] = ["3.10.13", "3.11.7", "3.12.1", "3.13.0"];

fn required() -> bool {
    std::env::var_os("CI").is_some_and(|v| v == "true")
        || std::env::var_os("FIRN_REQUIRE_BPF").is_some_and(|v| v == "1")
}

fn pyenv_root() -> Option<PathBuf> {
    let out = Command::new("pyenv").arg("root").output().ok()?;
    let root = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    root.is_dir().then_some(root)
}

/// (version, its executable, the file holding the interpreter, its include dirs).
fn interpreters() -> Vec<(String, PathBuf, PathBuf, Vec<PathBuf>)> {
    let mut v = vec![(
        "3.11.2".to_string(),
        PathBuf::from(DEBIAN),
        PathBuf::from(DEBIAN),
        vec![
            "/usr/include/python3.11".into(),
            "/usr/include/python3.11/internal".into(),
            "/usr/include/x86_64-linux-gnu/python3.11".into(),
        ],
    )];
    let root = pyenv_root();
    for full in PYENV {
        let minor = &full[..full.rfind('.').unwrap_or(full.len())];
        let dir = root.as_ref().map(|r| r.join("versions").join(full));
        match dir.filter(|d| d.is_dir()) {
            Some(d) => v.push((
                full.to_string(),
                d.join(format!("bin/python{minor}")),
                d.join(format!("lib/libpython{minor}.so.1.0")),
                vec![
                    d.join(format!("include/python{minor}")),
                    d.join(format!("include/python{minor}/internal")),
                ],
            )),
            // A machine with pyenv is one of ours: its builds must all be there.
            None if required() && root.is_some() => panic!("pyenv's CPython {full} is missing"),
            None => eprintln!("skipped: no pyenv CPython {full}"),
        }
    }
    v
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn finds_every_interpreter_here() {
    for (full, exe, lib, _) in interpreters() {
        let name = lib.to_string_lossy().into_owned();
        let i = analyze(&read(&lib), &name).unwrap_or_else(|e| panic!("{full}: {e}"));
        let minor = minor_from_name(&name).unwrap();
        assert_eq!((i.version.major, i.version.minor), (3, minor), "{full}");
        if minor >= 11 {
            assert_eq!(i.version.to_string(), full);
        }
        assert!(
            i.eval.end - i.eval.start > 10_000,
            "{full}: eval {:?}",
            i.eval
        );
        // The record the sampler will check passes its rules and survives the wire.
        let rec = i.to_record();
        assert_eq!(rec.check(), Ok(()), "{full}: {rec:?}");
        let back = firn_schema::python_record::Record::from_bytes(&rec.to_bytes());
        assert_eq!(back, Some(rec), "{full}");
        // pyenv's builds keep .symtab, so the cold part is found where gcc split one off
        // (3.11 and 3.12 here); Debian's is stripped.
        if exe != lib {
            let cold = i.eval_cold.clone();
            if minor == 11 || minor == 12 {
                let c = cold.unwrap_or_else(|| panic!("{full}: no eval .cold"));
                assert!(c.end > c.start && (c.end <= i.eval.start || c.start >= i.eval.end));
            }
            // The executable only imports the interpreter.
            let e = analyze(&read(&exe), &exe.to_string_lossy()).unwrap_err();
            assert!(!e.is_cpython(), "{full}: {e}");
        }
    }
}

#[test]
fn other_files_and_lies_are_refused() {
    let libc = read(Path::new("/usr/lib/x86_64-linux-gnu/libc.so.6"));
    assert!(!analyze(&libc, "libc.so.6").unwrap_err().is_cpython());
    assert_eq!(analyze(b"\x7fELF", "python3.11"), Err(AnalysisError::Elf));
    // A 3.11 under a 3.12 name.
    let debian = read(Path::new(DEBIAN));
    assert_eq!(
        analyze(&debian, "/usr/bin/python3.12"),
        Err(AnalysisError::NameMismatch {
            named: 12,
            found: 11
        })
    );
    // A Py_Version that names 3.9: no layout, counted as a CPython firn cannot read.
    let at = py_version_offset();
    let mut patched = debian.clone();
    patched[at..at + 4].copy_from_slice(&0x0309_0000u32.to_le_bytes());
    let e = analyze(&patched, "/usr/bin/python3").unwrap_err();
    assert_eq!(e, AnalysisError::UnknownVersion(3, 9));
    assert!(e.is_cpython());
}

/// Fuzzing found a file whose text segment's offset pushes the eval loop's range past
/// the end of the address space: it is refused, never recorded with its end before its
/// start (the sampler would refuse that record too).
#[test]
fn an_eval_range_past_the_address_space_is_refused() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/regressions/python_interpreter");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).expect("the regression inputs") {
        let data = read(&entry.expect("a regression input").path());
        for name in [
            "/usr/lib/libpython3.12.so.1.0",
            "/usr/bin/python3.10",
            "/bin/x",
        ] {
            if let Ok(i) = analyze(&data, name) {
                assert!(i.eval.start < i.eval.end, "{name}: {:?}", i.eval);
                if let Some(c) = &i.eval_cold {
                    assert!(c.start < c.end, "{name}: cold {c:?}");
                }
            }
        }
        seen += 1;
    }
    assert!(seen > 0);
}

/// The file offset of `Py_Version` in a non-PIE executable (vaddr − segment + offset).
fn py_version_offset() -> usize {
    let out = Command::new("readelf")
        .args(["-sW", "--dyn-syms", DEBIAN])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let vaddr = text
        .lines()
        .find(|l| l.ends_with(" Py_Version"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|a| u64::from_str_radix(a, 16).ok())
        .unwrap();
    let out = Command::new("readelf")
        .args(["-lW", DEBIAN])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    for l in text.lines().filter(|l| l.trim_start().starts_with("LOAD")) {
        let f: Vec<u64> = l
            .split_whitespace()
            .skip(1)
            .take(5)
            .map(|x| u64::from_str_radix(x.trim_start_matches("0x"), 16).unwrap_or(0))
            .collect();
        let (offset, v, filesz) = (f[0], f[1], f[3]);
        if vaddr >= v && vaddr < v + filesz {
            return usize::try_from(vaddr - v + offset).unwrap();
        }
    }
    panic!("Py_Version not in a PT_LOAD");
}

#[test]
fn layouts_match_the_headers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/python/offsets.c");
    let dir = std::env::temp_dir().join(format!("firn-pyoffsets-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (full, _, lib, includes) in interpreters() {
        let bin = dir.join(format!("offsets-{full}"));
        let mut cc = Command::new("gcc");
        cc.arg("-w").arg(&src).arg("-o").arg(&bin);
        for i in &includes {
            cc.arg("-I").arg(i);
        }
        let out = cc.output().expect("gcc runs");
        assert!(
            out.status.success(),
            "{full}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let out = Command::new(&bin).output().unwrap();
        let facts: std::collections::HashMap<String, u64> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.parse().unwrap()))
            .collect();
        let f = |k: &str| *facts.get(k).unwrap_or_else(|| panic!("{full}: no {k}"));
        let l = analyze(&read(&lib), &lib.to_string_lossy()).unwrap().layout;
        let minor = minor_from_name(&lib.to_string_lossy()).unwrap();
        let interpreters = if minor >= 13 {
            "runtime.interpreters_head"
        } else {
            "runtime.interpreters_main"
        };
        let pairs: Vec<(&str, u64, u64)> = vec![
            (interpreters, l.runtime_interpreters.into(), f(interpreters)),
            ("runtime.size", l.runtime_size, f("runtime.size")),
            (
                "interp.threads_head",
                l.interp_threads_head.into(),
                f("interp.threads_head"),
            ),
            ("tstate.next", l.tstate_next.into(), f("tstate.next")),
            (
                "tstate.thread_id",
                l.tstate_thread_id.into(),
                f("tstate.thread_id"),
            ),
            (
                "frame.previous",
                l.frame_previous.into(),
                f("frame.previous"),
            ),
            ("frame.code", l.frame_code.into(), f("frame.code")),
            ("frame.instr", l.frame_instr.into(), f("frame.instr")),
            ("code.size", l.code_size, f("code.size")),
            ("code.filename", l.code_filename.into(), f("code.filename")),
            (
                "code.linetable",
                l.code_linetable.into(),
                f("code.linetable"),
            ),
            (
                "code.firstlineno",
                l.code_firstlineno.into(),
                f("code.firstlineno"),
            ),
            ("object.ob_type", l.object_type.into(), f("object.ob_type")),
            ("type.tp_name", l.type_name.into(), f("type.tp_name")),
            (
                "type.tp_basicsize",
                l.type_basicsize.into(),
                f("type.tp_basicsize"),
            ),
            ("bytes.ob_size", l.bytes_size.into(), f("bytes.ob_size")),
            ("bytes.ob_sval", l.bytes_data.into(), f("bytes.ob_sval")),
            ("unicode.state", l.str_state.into(), f("unicode.state")),
            ("unicode.length", l.str_length.into(), f("unicode.length")),
            (
                "unicode.asciiobject_size",
                l.str_ascii_data.into(),
                f("unicode.asciiobject_size"),
            ),
        ];
        for (name, ours, theirs) in pairs {
            assert_eq!(ours, theirs, "{full}: {name}");
        }
        let name_field = if minor >= 11 {
            "code.qualname"
        } else {
            "code.name"
        };
        assert_eq!(u64::from(l.code_name), f(name_field), "{full}");
        match (minor, l.cframe_frame, l.position, l.boundary) {
            (10, None, Position::LastiIndex, Boundary::OneFramePerCall) => {
                assert_eq!(u64::from(l.tstate_frame), f("tstate.frame"));
            }
            (11 | 12, Some(c), Position::Pointer { code_adaptive }, b) => {
                assert_eq!(u64::from(l.tstate_frame), f("tstate.cframe"), "{full}");
                assert_eq!(u64::from(c), f("cframe.current_frame"), "{full}");
                assert_eq!(u64::from(code_adaptive), f("code.co_code_adaptive"));
                match b {
                    Boundary::IsEntry(o) => assert_eq!(u64::from(o), f("frame.is_entry")),
                    Boundary::Owner { offset, cstack } => {
                        assert_eq!(u64::from(offset), f("frame.owner"));
                        assert_eq!(u64::from(cstack), f("owner.cstack"));
                    }
                    Boundary::OneFramePerCall => panic!("{full}: no boundary"),
                }
            }
            (13, None, Position::Pointer { code_adaptive }, Boundary::Owner { offset, cstack }) => {
                assert_eq!(u64::from(l.tstate_frame), f("tstate.current_frame"));
                assert_eq!(u64::from(code_adaptive), f("code.co_code_adaptive"));
                assert_eq!(u64::from(offset), f("frame.owner"));
                assert_eq!(u64::from(cstack), f("owner.cstack"));
            }
            other => panic!("{full}: unexpected {other:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// (start, end, line) as `co_lines()` yields it.
type LineRange = (u64, u64, Option<i64>);

/// Every code object of a few modules, with CPython's own `co_lines()`: the decoder
/// must give the line CPython gives at every instruction.
const DUMP_LINES: &str = r#"
import json, sys, types, importlib
out = []
def walk(co):
    out.append([co.co_firstlineno, co.co_linetable.hex(), list(co.co_lines())])
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            walk(c)
for name in ["json.decoder", "asyncio.base_events", "argparse", "email.message"]:
    m = importlib.import_module(name)
    src = open(m.__file__).read()
    walk(compile(src, m.__file__, "exec"))
json.dump(out, sys.stdout)
"#;

#[test]
fn line_tables_decode_as_cpython_does() {
    for (full, exe, _, _) in interpreters() {
        let out = Command::new(&exe)
            .args(["-c", DUMP_LINES])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{full}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let codes: Vec<(i32, String, Vec<LineRange>)> =
            serde_json::from_slice(&out.stdout).unwrap();
        let minor = minor_from_name(&exe.to_string_lossy()).unwrap();
        let format = LineFormat::of_minor(minor).unwrap();
        let mut checked = 0;
        for (first, hex, lines) in &codes {
            let table: Vec<u8> = (0..hex.len() / 2)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
                .collect();
            for &(start, end, line) in lines {
                for at in (start..end).step_by(2) {
                    let want = line.filter(|l| *l > 0).map(|l| l as u32);
                    let got = line_at(format, &table, *first, at as u32);
                    assert_eq!(got, want, "{full}: offset {at} of a code at line {first}");
                    checked += 1;
                }
            }
        }
        assert!(
            codes.len() > 300 && checked > 10_000,
            "{full}: {} codes, {checked} offsets",
            codes.len()
        );
        eprintln!(
            "{full}: {checked} offsets of {} code objects as CPython says",
            codes.len()
        );
    }
}

/// Reads a live process as the BPF walk will, through `/proc/PID/mem` (the test's own
/// child; the enricher never does this): the record's addresses and offsets must lead
/// from `_PyRuntime` to the thread's frames and their code objects' names.
struct Live {
    mem: std::fs::File,
    /// What the process adds to the file's virtual addresses.
    bias: u64,
}

impl Live {
    fn word(&self, addr: u64) -> u64 {
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 8];
        self.mem
            .read_exact_at(&mut b, addr)
            .unwrap_or_else(|e| panic!("read {addr:#x}: {e}"));
        u64::from_le_bytes(b)
    }

    fn bytes(&self, addr: u64, n: usize) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let mut b = vec![0u8; n];
        self.mem.read_exact_at(&mut b, addr).unwrap();
        b
    }

    fn c_str(&self, addr: u64) -> String {
        let b = self.bytes(addr, 32);
        String::from_utf8_lossy(&b[..b.iter().position(|c| *c == 0).unwrap_or(32)]).into_owned()
    }

    /// A compact ASCII str's characters, its type checked first.
    fn ascii(&self, obj: u64, i: &Interpreter) -> String {
        let l = &i.layout;
        assert_eq!(
            self.word(obj + u64::from(l.object_type)),
            i.str_type + self.bias
        );
        let len = self.word(obj + u64::from(l.str_length));
        let state = self.word(obj + u64::from(l.str_state)) as u32;
        assert_eq!((state >> 5) & 3, 3, "compact and ascii");
        let n = usize::try_from(len.min(200)).unwrap();
        String::from_utf8(self.bytes(obj + u64::from(l.str_ascii_data), n)).unwrap()
    }
}

/// The executable mapping of `file` in `pid`'s maps that holds file offset `off`.
fn exec_mapping(pid: u32, file: &Path, off: u64) -> Option<(u64, u64)> {
    let canon = std::fs::canonicalize(file).ok()?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        let (range, perms, offset, path) = (f[0], f[1], f[2], f.get(5)?);
        let (s, e) = range.split_once('-')?;
        let (s, e) = (
            u64::from_str_radix(s, 16).ok()?,
            u64::from_str_radix(e, 16).ok()?,
        );
        let o = u64::from_str_radix(offset, 16).ok()?;
        (perms.contains('x') && Path::new(path) == canon && off >= o && off < o + (e - s))
            .then_some((s, o))
    })
}

const NESTED: &str = r#"
import sys, time
class K:
    def method(self):
        return leaf()
def leaf():
    print("ready", flush=True)
    time.sleep(60)
def outer():
    return K().method()
outer()
"#;

#[test]
fn records_lead_to_the_frames_of_a_live_process() {
    use std::io::BufRead;
    for (full, exe, lib, _) in interpreters() {
        let i = analyze(&read(&lib), &lib.to_string_lossy()).unwrap();
        let mut child = Command::new(&exe)
            .args(["-c", NESTED])
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "{full}");
        let pid = child.id();
        let (start, offset) = exec_mapping(pid, &lib, i.eval.start)
            .unwrap_or_else(|| panic!("{full}: no executable mapping of the eval loop"));
        let bias = start.wrapping_sub(offset).wrapping_sub(i.text_delta);
        let live = Live {
            mem: std::fs::File::open(format!("/proc/{pid}/mem")).unwrap(),
            bias,
        };
        let l = &i.layout;
        for (ty, name) in [
            (i.code_type, "code"),
            (i.str_type, "str"),
            (i.bytes_type, "bytes"),
        ] {
            let tp_name = live.word(bias + ty + u64::from(l.type_name));
            assert_eq!(live.c_str(tp_name), name, "{full}");
        }
        let interp = live.word(bias + i.runtime + u64::from(l.runtime_interpreters));
        let tstate = live.word(interp + u64::from(l.interp_threads_head));
        assert_ne!(tstate, 0, "{full}: no thread state");
        let mut frame = live.word(tstate + u64::from(l.tstate_frame));
        if let Some(c) = l.cframe_frame {
            frame = live.word(frame + u64::from(c));
        }
        let mut names = Vec::new();
        for _ in 0..32 {
            if frame == 0 {
                break;
            }
            let shim = match l.boundary {
                Boundary::Owner { offset, cstack } => {
                    live.bytes(frame + u64::from(offset), 1)[0] >= cstack
                }
                _ => false,
            };
            if !shim {
                let code =
                    live.word(frame + u64::from(l.frame_code)) & !u64::from(l.frame_code_tag_bits);
                assert_eq!(
                    live.word(code + u64::from(l.object_type)),
                    bias + i.code_type,
                    "{full}"
                );
                names.push(live.ascii(live.word(code + u64::from(l.code_name)), &i));
                let file = live.ascii(live.word(code + u64::from(l.code_filename)), &i);
                assert_eq!(file, "<string>", "{full}");
            }
            frame = live.word(frame + u64::from(l.frame_previous));
        }
        child.kill().ok();
        child.wait().ok();
        let want: &[&str] = if i.version.minor >= 11 {
            &["leaf", "K.method", "outer", "<module>"]
        } else {
            &["leaf", "method", "outer", "<module>"]
        };
        assert_eq!(names, want, "{full}");
    }
}
