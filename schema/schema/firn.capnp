@0x81ff6f1cc72bc6b3;
# The only contract between firn-sampler (privileged producer) and firn-enricher.
# Identifiers in here (sessionId, processId) are issued by the sampler and only mean
# something within one sampler session. No kernel address is ever carried: kernel
# frames travel as indices into a per-batch table of names.

const protocolVersion :UInt32 = 4;

interface Sampler {
  info @0 (protocolVersion :UInt32) -> (info :Info);
  # Describes the sampler. To a caller of another protocol version it answers only
  # info.protocolVersion and info.samplerVersion, then closes the connection: this
  # method's ordinal and those two fields never change between versions.

  subscribe @1 (protocolVersion :UInt32, sink :BatchSink)
      -> (subscription :Subscription, brokerKey :Data);
  # Starts streaming one Batch per round to `sink`. The subscription lasts while the
  # caller holds `subscription` (or until the connection closes). `brokerKey` binds a
  # second connection, the broker channel, to this subscription: the client connects
  # again and sends brokerMagic followed by the key; file descriptors then arrive there.
}

const brokerMagic :Data = "FIRNBRK1";
# First bytes of a broker channel. As a Cap'n Proto segment count it is impossible, so a
# broker channel can never be mistaken for an RPC connection.

interface BatchSink {
  push @0 (batch :Batch) -> stream;
  # Streaming call: the sampler waits for flow control, never for the enricher's work.

  announce @1 (processes :List(Process)) -> stream;
  # Process records read since the last batch, sent as soon as they are read (a new
  # process's first sample), so that the subscriber can send the unwind tables of its
  # files before the round ends. A record announced is not sent again in a batch; it
  # is what openMapping, loadUnwindTable and loadInterpreter may name, like a batch's.
}

interface Subscription {
  # Held by the subscriber; dropping it ends the subscription.

  openMapping @0 (processId :UInt64, mappingIndex :UInt32, mappingsVersion :UInt32)
      -> (result :OpenResult);
  # Asks for a read-only fd of the file behind mapping `mappingIndex` of a process record
  # this subscription received. Identifiers only, never paths: the sampler opens the
  # path it read itself, inside the process's root, and checks device and inode. On
  # success the fd is sent on the broker channel in a message tagged with the ticket,
  # before this call returns.

  loadUnwindTable @1 (processId :UInt64, mappingIndex :UInt32, mappingsVersion :UInt32,
                      firstRow :UInt32, totalRows :UInt32, rows :Data)
      -> (result :TableResult);
  # Installs, for the file behind mapping `mappingIndex` of a process record this
  # subscription received, the table the BPF unwinder walks: `totalRows` rows of 8 bytes
  # (see unwindRowBytes), sent in order in chunks of at most maxTableChunkRows, this
  # chunk starting at row `firstRow`. The sampler checks every row (sorted, kinds and
  # offsets in range) and its budgets, and writes the rows into BPF maps. The table
  # applies to that file in every process and lasts while this subscription does. A
  # malformed chunk closes the connection; a chunk for another file than the pending
  # one abandons the pending table.

  loadInterpreter @2 (processId :UInt64, mappingIndex :UInt32, mappingsVersion :UInt32,
                      record :Data) -> (result :InterpreterResult);
  # Tells the BPF walk where the CPython interpreter of a process this subscription
  # received is: `record` is the 128-byte record of firn_schema::python_record, for the
  # file behind mapping `mappingIndex`, which holds the record's eval loop. The sampler
  # checks every field (known version, that version's standard layout, addresses in
  # user space near the mapping, the eval loop inside it) and places the addresses in
  # the process; the walk still checks in the process's memory that what it reads is
  # the interpreter's code, str and bytes objects. It applies to that process while it
  # lives and this subscription provides the tables.
}

const pythonRecordBytes :UInt32 = 128;

struct InterpreterResult {
  union {
    done @0 :Void;
    refused @1 :InterpreterRefusal;
  }
}

enum InterpreterRefusal {
  unknownProcess @0;      # forgotten, or never sent to this subscription
  unknownMapping @1;
  invalid @2;             # a field failed the record's check (counted by reason)
  outsideMapping @3;      # the eval loop or an object lies outside the mapping's reach
  notOwner @4;            # another subscription provides the tables
  rateLimited @5;
  noRoom @6;              # the interpreter map is full
  disabled @7;            # the sampler runs without the unwinder
}

const unwindRowBytes :UInt32 = 8;
# A row, little-endian: pc (UInt32, file offset from which the row holds), cfaOffset
# (UInt16), kinds (UInt8: CFA kind | rbp kind << 4), rbpOffset8 (Int8, words from the
# CFA). The kinds are those of sampler-bpf/src/bpf/profile.bpf.h.

const maxTableChunkRows :UInt32 = 32768;

struct TableResult {
  union {
    done @0 :Void;        # the chunk was taken; after the last, the table is in use
    refused @1 :TableRefusal;
  }
}

enum TableRefusal {
  unknownProcess @0;      # forgotten, or never sent to this subscription
  unknownMapping @1;
  tooLarge @2;            # over the per-table row limit (--unwind-table-rows)
  noRoom @3;              # the row pool is full of tables in use (--unwind-rows)
  notOwner @4;            # another subscription provides the tables
  rateLimited @5;
  outOfOrder @6;          # a chunk that does not continue the pending table
  disabled @7;            # the sampler runs without the unwinder's tables
}

struct OpenResult {
  union {
    ticket @0 :UInt64;
    refused @1 :Refusal;
  }
}

enum Refusal {
  unknownProcess @0;     # never sent to this subscription, or forgotten
  unknownMapping @1;     # index out of range, or a version this subscription never saw
  processGone @2;        # the process exited or its pid was reused
  deleted @3;            # the mapped file was deleted or replaced since it was mapped
  notRegularFile @4;
  identityMismatch @5;   # device or inode differ from the mapping's
  openFailed @6;
  rateLimited @7;
  noBrokerChannel @8;    # the broker channel is not connected
  channelFull @9;        # the subscriber does not read its broker channel
  obsoleteUnsupported @10; # never sent (kept so that the numbering stays)
}

struct Info {
  protocolVersion @0 :UInt32;
  samplerVersion @1 :Text;
  node @2 :Text;
  kernelRelease @3 :Text;
  sessionId @4 :UInt64;
  frequencyHz @5 :UInt32;
  roundSeconds @6 :UInt32;
  keptCapabilities @7 :List(Text);
  counters @8 :List(Counter);
  offCpuEvery @9 :UInt32;        # one voluntary switch in this many at least is timed (the rate may raise it); 0: off
  offCpuMinNs @10 :UInt64;       # waits under it are skipped
  offCpuRate @11 :UInt32;        # at most about this many are timed a second per CPU; 0: no bound
}

struct Counter {
  name @0 :Text;
  value @1 :UInt64;
}

struct Batch {
  sessionId @0 :UInt64;
  round @1 :UInt64;              # sequence number of the round within the session
  startTimeNs @2 :UInt64;        # wall clock, Unix ns, of the round's start
  endTimeNs @3 :UInt64;
  frequencyHz @4 :UInt32;
  processes @5 :List(Process);   # records the samples of this batch need, not sent before
  samples @6 :List(Sample);
  kernelSymbols @7 :List(Text);  # interned kernel function names of this batch
  counters @8 :List(Counter);    # cumulative since the sampler started
  droppedBatches @9 :UInt64;     # batches this subscriber lost to its full queue, in all
  forgottenProcesses @10 :List(UInt64);
  # Process ids the sampler forgot (the process exited): later ids are new processes,
  # and these records may be dropped once the samples above are handled.
  unwindTablesEvicted @11 :UInt64;
  # Unwind tables the sampler removed to make room, in all (cumulative): a subscriber
  # that sent tables sends those again when their files are mapped again.
  pythonCode @12 :List(Data);
  # What names the Python code objects the BPF walk met for the first time, each as it
  # copied it from the process (the sampler reads only the three lengths, to cut the
  # unused bytes): 24 bytes of header, id (UInt64, the code id of the frames that name
  # it), firstLine (UInt32), nameLen, fileLen, tableLen (UInt16), minor, flags (UInt8),
  # 4 zero bytes; then the qualname, the file name and the line table bytes. Each is at
  # most pythonCodeMaxBytes; untrusted content from the profiled process.
  cgroups @13 :List(Cgroup);
  # The path of each cgroup id this batch's samples name, where the sampler knows it:
  # the `0::` line of /proc/<pid>/cgroup of a process sampled in it, read when it was
  # first seen there (the v1 lines of a hybrid host are the process record's own).
  offCpu @14 :Bool;
  # The sampler times off-CPU waits (--off-cpu): profiles carry an off-CPU sample type
  # in every round, even one with no wait.
}

struct Cgroup {
  id @0 :UInt64;                 # the kernel's cgroup v2 id (a cgroupfs inode number)
  path @1 :Data;                 # the `0::/…` line, newline included, bounded
}

const pythonCodeMaxBytes :UInt32 = 3992;
const maxPythonCodes :UInt32 = 2048;

struct Process {
  processId @0 :UInt64;          # identity of (pid, startTimeNs) within the session
  pid @1 :UInt32;
  startTimeNs @2 :UInt64;        # since boot, of the thread group leader
  ppid @3 :UInt32;
  uid @4 :UInt32;
  comm @5 :Data;
  exe @6 :Data;                  # target of /proc/<pid>/exe, as the kernel printed it
  cmdline @7 :List(Data);        # bounded: argument count and bytes are capped
  cgroup @8 :Data;               # /proc/<pid>/cgroup, bounded
  mappings @9 :List(Mapping);    # executable file mappings only
  mappingsVersion @10 :UInt32;   # bumped each time the mappings were read again (dlopen)
  complete @11 :Bool;            # false: gone before /proc could be read: pid, start, comm from BPF; exe and mappings, if set, are its executable placed from another process of that file
  firstSampleNs @12 :UInt64;
  # CLOCK_BOOTTIME ns at which the sampler learnt of the process's first sample (its
  # BPF event); 0 when it was found in a round's samples instead.
}

struct Mapping {
  start @0 :UInt64;
  end @1 :UInt64;
  fileOffset @2 :UInt64;
  devMajor @3 :UInt32;
  devMinor @4 :UInt32;
  inode @5 :UInt64;
  path @6 :Data;
}

enum StackStatus {
  ok @0;
  absent @1;                     # none of this kind (kernel thread, user-mode sample)
  lost @2;                       # the stack map had no room; counted in the counters
  error @3;                      # the kernel could not read it; counted in the counters
}

enum UnwindEnd {
  # Why a user stack ended (the values are profile.bpf.h's enum firn_unwind_end; the
  # sampler asserts they agree).
  complete @0;            # a table row said this is the outermost frame
  noProcess @1;           # the process's mappings were not known yet: the leaf only
  noMapping @2;           # pc in anonymous executable code (JIT, vDSO): frame pointers
  noTable @3;             # the file had no table: frame pointers from there
  notInTable @4;          # the table has no row for the pc: frame pointers from there
  unsupported @5;         # a rule the unwinder cannot follow
  readFault @6;           # no longer sent (a failed read ends as badFrame)
  depthLimit @7;          # 127 frames
  badFrame @8;            # the caller's frame failed a check: its return address is not
                          # code of the process (a wrong table or frame pointer, or code
                          # mapped since its record), or it lay outside the stack window
}

struct Sample {
  # A user frame with bit 63 set and bit 62 clear is a Python frame: a code id (bits 20
  # to 61, see Batch.pythonCode) and an instruction index (bits 0 to 19, in 2-byte code
  # units), in the place of the eval loop's native frame that ran it.
  processId @0 :UInt64;          # 0 when no process record exists (see `complete`)
  pid @1 :UInt32;
  tid @2 :UInt32;
  comm @3 :Data;                 # the thread's comm when sampled
  count @4 :UInt64;
  userFrames @5 :List(UInt64);   # return addresses, innermost first
  kernelFrames @6 :List(UInt32); # indices into Batch.kernelSymbols, innermost first
  userStack @7 :StackStatus;
  kernelStack @8 :StackStatus;
  userStackEnd @9 :UnwindEnd;
  cgroupId @10 :UInt64;
  # The cgroup v2 id the sample was taken in (0: unknown): its path, if known, is in
  # this batch's cgroups. A process that moves keeps its record, and its samples from
  # then on name the new cgroup.
  offCpuNs @11 :UInt64;
  # Nanoseconds the thread waited off CPU under these stacks (--off-cpu; weighted, see
  # the sampler's README); such a sample has count 0. An on-CPU sample has 0 here.
}
