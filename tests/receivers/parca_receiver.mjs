// A Parca stand-in for firn's tests: a gRPC server (@grpc/grpc-js) that decodes what
// firn sends with Parca's own published client types (@parca/client, protobuf-ts) and
// reads each raw pprof with pprof-format, checking what Parca's normalizer checks:
// a __name__ label, valid and unique label names, string_table[0] == "", sequential
// mapping/location/function ids, and one executable_info per mapping when any is sent.
// A request that fails is answered INVALID_ARGUMENT, as Parca would. It also plays the
// debuginfo upload service. Everything that arrives is one JSON line in --out.
//
// Options: --port N --out FILE [--delay-ms N] [--fail CODE:N[,CODE:N…]] [--token T]
// [--known ID,…]. Failures apply to the first WriteRaw calls, in order.
import { createHash } from "node:crypto";
import { appendFileSync } from "node:fs";
import { gunzipSync } from "node:zlib";
import grpc from "@grpc/grpc-js";
import { Profile } from "pprof-format";
import {
    WriteRawRequest, WriteRawResponse,
} from "@parca/client/dist/parca/profilestore/v1alpha1/profilestore.js";
import {
    ShouldInitiateUploadRequest, ShouldInitiateUploadResponse,
    InitiateUploadRequest, InitiateUploadResponse,
    UploadRequest, UploadResponse,
    MarkUploadFinishedRequest, MarkUploadFinishedResponse,
    UploadInstructions_UploadStrategy,
} from "@parca/client/dist/parca/debuginfo/v1alpha1/debuginfo.js";

const args = {};
for (let i = 2; i < process.argv.length; i += 2) {
    args[process.argv[i].replace(/^--/, "")] = process.argv[i + 1];
}
const out = args.out;
const delayMs = Number(args["delay-ms"] || 0);
const failures = [];
for (const item of (args.fail || "").split(",").filter(Boolean)) {
    const [code, n] = item.split(":");
    for (let i = 0; i < Number(n || 1); i++) failures.push(code);
}
const known = new Set((args.known || "").split(",").filter(Boolean));
const record = (o) => appendFileSync(out, JSON.stringify({ ...o, t: Date.now() / 1000 }, (_, v) => (typeof v === "bigint" ? (Number.isSafeInteger(Number(v)) ? Number(v) : String(v)) : v)) + "\n");
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function authorized(call) {
    if (!args.token) return true;
    const got = call.metadata.get("authorization")[0];
    return got === `Bearer ${args.token}`;
}

const VALID = /^[a-zA-Z_][a-zA-Z0-9_]*$/;

function readPprof(raw, executableInfo, errors) {
    let p;
    try {
        p = Profile.decode(gunzipSync(Buffer.from(raw)));
    } catch (e) {
        errors.push(`pprof does not decode: ${e}`);
        return null;
    }
    const str = p.stringTable.strings;
    if (str[0] !== "") errors.push("string_table[0] is not empty");
    for (const [what, list] of [["mapping", p.mapping], ["location", p.location], ["function", p.function]]) {
        list.forEach((x, i) => {
            if (Number(x.id) !== i + 1) errors.push(`${what} ids are not sequential (${what}[${i}].id = ${x.id})`);
        });
    }
    if (executableInfo.length > 0 && executableInfo.length !== p.mapping.length) {
        errors.push(`${executableInfo.length} executable_info for ${p.mapping.length} mappings`);
    }
    const fn = new Map(p.function.map((f) => [Number(f.id), str[Number(f.name)]]));
    const loc = new Map(p.location.map((l) => [Number(l.id), l]));
    const types = p.sampleType.map((t) => `${str[Number(t.type)]}/${str[Number(t.unit)]}`);
    const stacks = [];
    const totals = types.map(() => 0);
    for (const s of p.sample) {
        const names = [];
        for (const id of s.locationId) {
            const l = loc.get(Number(id));
            if (!l) { errors.push(`sample names missing location ${id}`); continue; }
            if (l.line.length === 0) names.push(null);
            for (const line of l.line) names.push(fn.get(Number(line.functionId)) ?? null);
        }
        s.value.forEach((v, i) => { totals[i] += Number(v); });
        stacks.push({ value: Number(s.value[0]), frames: names });
    }
    const mappings = p.mapping.map((m) => ({ file: str[Number(m.filename)], build_id: str[Number(m.buildId)] }));
    const pt = p.periodType;
    const period_type = pt ? `${str[Number(pt.type)]}/${str[Number(pt.unit)]}` : "";
    return { types, totals, stacks, mappings, period_type, period: Number(p.period), time_nanos: String(p.timeNanos) };
}

function unary(I, O, handler) {
    return {
        requestStream: false, responseStream: false,
        requestDeserialize: (b) => I.fromBinary(b), responseSerialize: (m) => Buffer.from(O.toBinary(m)),
        handler: async (call, cb) => {
            try {
                if (!authorized(call)) return cb({ code: grpc.status.UNAUTHENTICATED, details: "bad token" });
                cb(null, await handler(call.request));
            } catch (e) {
                cb({ code: e.code ?? grpc.status.INTERNAL, details: String(e.details ?? e) });
            }
        },
    };
}

const writeRaw = unary(WriteRawRequest, WriteRawResponse, async (req) => {
    if (delayMs) await sleep(delayMs);
    if (failures.length > 0) {
        const code = failures.shift();
        record({ kind: "failed", code });
        throw { code: grpc.status[code], details: "test receiver: configured failure" };
    }
    const errors = [];
    const series = req.series.map((s) => {
        const labels = {};
        for (const l of s.labels?.labels ?? []) {
            if (!VALID.test(l.name)) errors.push(`invalid label name ${JSON.stringify(l.name)}`);
            if (l.name in labels) errors.push(`duplicate label ${l.name}`);
            labels[l.name] = l.value;
        }
        if (!labels.__name__) errors.push("series without __name__");
        const samples = s.samples.map((r) => readPprof(r.rawProfile, r.executableInfo, errors));
        return { labels, samples };
    });
    record({ kind: "writeraw", normalized: req.normalized, series, errors });
    if (errors.length) throw { code: grpc.status.INVALID_ARGUMENT, details: errors.slice(0, 5).join("; ") };
    return WriteRawResponse.create();
});

const uploads = new Map();
const debuginfo = {
    ShouldInitiateUpload: unary(ShouldInitiateUploadRequest, ShouldInitiateUploadResponse, async (req) => {
        const has = known.has(req.buildId);
        record({ kind: "should", build_id: req.buildId, type: req.type, answer: !has });
        return ShouldInitiateUploadResponse.create({ shouldInitiateUpload: !has, reason: has ? "already present" : "" });
    }),
    InitiateUpload: unary(InitiateUploadRequest, InitiateUploadResponse, async (req) => {
        const id = `up-${uploads.size + 1}`;
        uploads.set(id, { buildId: req.buildId, size: Number(req.size) });
        return InitiateUploadResponse.create({
            uploadInstructions: { buildId: req.buildId, uploadId: id, uploadStrategy: UploadInstructions_UploadStrategy.GRPC, type: req.type },
        });
    }),
    Upload: {
        requestStream: true, responseStream: false,
        requestDeserialize: (b) => UploadRequest.fromBinary(b), responseSerialize: (m) => Buffer.from(UploadResponse.toBinary(m)),
        handler: (call, cb) => {
            if (!authorized(call)) return cb({ code: grpc.status.UNAUTHENTICATED, details: "bad token" });
            let info = null; const hash = createHash("sha256"); let size = 0; const errors = [];
            call.on("data", (m) => {
                if (m.data.oneofKind === "info") {
                    if (info) errors.push("second info message");
                    info = m.data.info;
                } else if (m.data.oneofKind === "chunkData") {
                    if (!info) errors.push("chunk before info");
                    hash.update(m.data.chunkData); size += m.data.chunkData.length;
                }
            });
            call.on("end", () => {
                const up = info && uploads.get(info.uploadId);
                if (!up) errors.push("upload without a known upload id");
                else if (up.size !== size) errors.push(`declared ${up.size} bytes, sent ${size}`);
                record({ kind: "upload", build_id: info?.buildId, upload_id: info?.uploadId, size, sha256: hash.digest("hex"), errors });
                if (errors.length) return cb({ code: grpc.status.INVALID_ARGUMENT, details: errors.join("; ") });
                cb(null, UploadResponse.create({ buildId: info.buildId, size: BigInt(size) }));
            });
        },
    },
    MarkUploadFinished: unary(MarkUploadFinishedRequest, MarkUploadFinishedResponse, async (req) => {
        record({ kind: "finished", build_id: req.buildId, upload_id: req.uploadId, known_upload: uploads.has(req.uploadId) });
        return MarkUploadFinishedResponse.create();
    }),
};

function service(name, methods) {
    const def = {}; const impl = {};
    for (const [m, d] of Object.entries(methods)) {
        def[m] = { path: `/${name}/${m}`, requestStream: d.requestStream, responseStream: d.responseStream,
            requestDeserialize: d.requestDeserialize, responseSerialize: d.responseSerialize,
            requestSerialize: () => Buffer.alloc(0), responseDeserialize: () => ({}) };
        impl[m] = d.handler;
    }
    return [def, impl];
}

const server = new grpc.Server({ "grpc.max_receive_message_length": 64 << 20 });
server.addService(...service("parca.profilestore.v1alpha1.ProfileStoreService", { WriteRaw: writeRaw }));
server.addService(...service("parca.debuginfo.v1alpha1.DebuginfoService", debuginfo));
server.bindAsync(`127.0.0.1:${args.port}`, grpc.ServerCredentials.createInsecure(), (err) => {
    if (err) { console.error(err); process.exit(1); }
    console.log(`parca receiver listening on ${args.port}`);
});
