#!/usr/bin/env python3
"""Writes the seed corpus of every fuzz target into fuzz/corpus/<target>/ (small files only).

Run from anywhere; rerunning rewrites the same files. The layers are built with Python's tarfile
(ustar, GNU and PAX formats) plus hand-made GNU and PAX sparse entries and hostile shapes
(`..`, absolute paths, symlinks out, oversized extension headers' size fields).
"""
import hashlib
import io
import os
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


# --- reference ---------------------------------------------------------------------------------
H = "sha256:" + "a" * 64
refs = [
    "busybox", "busybox:1.36", "library/busybox", "docker.io/library/busybox:latest",
    "registry.k8s.io/pause:3.10", "127.0.0.1:5000/app:v1", "localhost/app", "localhost:5000/a/b/c",
    "[::1]:5000/x:y", f"busybox@{H}", f"quay.io/a/b:t@{H}", "UPPER/case", "a:b:c", "a//b",
    "", " busybox", "busybox:", "@" + H, "x@sha256:short", "registry.example/app:" + "t" * 128,
    "127.evil.example/app", "a/b/c/d/e/f:tag_1.2-3",
]
for i, r in enumerate(refs):
    put("reference", f"ref{i:02}", r)

# --- manifest ----------------------------------------------------------------------------------
D = "sha256:" + "b" * 64
manifests = {
    "oci-manifest": '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",'
    f'"config":{{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"{D}","size":10}},'
    f'"layers":[{{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"{D}","size":5}}]}}',
    "docker-manifest": '{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json",'
    f'"config":{{"mediaType":"application/vnd.docker.container.image.v1+json","digest":"{D}","size":1}},'
    f'"layers":[{{"mediaType":"application/vnd.docker.image.rootfs.diff.tar.gzip","digest":"{D}","size":-1}}]}}',
    "oci-index": '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":['
    f'{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{D}","size":3,'
    '"platform":{"os":"linux","architecture":"amd64"}},'
    f'{{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"{D}","size":3,'
    '"platform":{"os":"linux","architecture":"arm","variant":"v7"}}]}',
    "docker-list": '{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.list.v2+json",'
    f'"manifests":[{{"digest":"{D}","size":1,"platform":{{"os":"linux","architecture":"amd64"}}}}]}}',
    "schema1": '{"schemaVersion":1,"name":"x","tag":"y","fsLayers":[]}',
    "unknown-type": '{"schemaVersion":2,"mediaType":"text/plain","config":{}}',
    "neither": '{"schemaVersion":2}',
    "config": '{"architecture":"amd64","os":"linux","config":{"User":"1000:1000","Env":["A=b"],'
    '"Entrypoint":["/bin/sh"]},"rootfs":{"type":"layers","diff_ids":["' + D + '"]}}',
    "config-user-name": '{"config":{"User":"nobody"},"rootfs":{"diff_ids":[]}}',
    "not-json": "\x00\xff{",
    "deep": "[" * 64 + "]" * 64,
    "zstd-layer": '{"schemaVersion":2,"config":{"mediaType":"x","digest":"' + D + '","size":1},'
    '"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+zstd","digest":"' + D + '","size":1}]}',
}
for name, text in manifests.items():
    put("manifest", name, text)

# --- hosts_toml --------------------------------------------------------------------------------
hosts = {
    "mirror": 'server = "https://registry-1.docker.io"\n[host."https://mirror.example"]\n'
    '  capabilities = ["pull", "resolve"]\n',
    "http-mirror": '[host."http://10.0.0.1:5000"]\n  capabilities = ["pull"]\n  skip_verify = true\n',
    "ca-list": '[host."https://m.example:5000"]\n  ca = ["/etc/a.pem", "/etc/b.pem"]\n',
    "ca-one": 'server = "https://r.example"\nca = "/etc/ca.pem"\nskip_verify = false\n',
    "override-path": '[host."https://m.example/v2/proxy"]\n  override_path = true\n',
    "bad-scheme": '[host."ftp://x"]\n',
    "empty-host": '[host."https://"]\n',
    "caps-none": 'capabilities = []\n',
    "server-http": 'server = "http://127.0.0.1:5000"\n',
    "loopback-names": '[host."127.evil.example:5000"]\n[host."localhost:5000"]\n',
    "not-toml": "[[[",
    # Found by fuzzing: a host with TOML escapes (and characters no host has).
    "escaped-host": '[host."http://plm:##5##ost:0ple:5\\b\\bbbbb###(###001"]\n',
    # Found by fuzzing: an ignored key whose integer overflows, beside a plain-http server.
    "overflowing-ignored-key": 'se =666666666666666666666\nserver = "http://977.0.0.1:5/100 "\n',
    "empty": "",
}
for name, text in hosts.items():
    put("hosts_toml", name, text)

# --- cri_log -----------------------------------------------------------------------------------
logs = {
    "one": "2026-11-21T10:49:26.123456789Z stdout F hello world\n",
    "partial": "2026-11-21T10:49:26.000000001Z stdout P abc\n2026-11-21T10:49:26.000000002Z stdout F def\n",
    "mixed": "2026-11-21T10:49:26.1Z stderr P x\n2026-11-21T10:49:26.2Z stdout F y\n"
    "2026-11-21T10:49:26.3Z stderr F z\n",
    "bad-stream": "2026-11-21T10:49:26Z stdin F x\n",
    "bad-tag": "2026-11-21T10:49:26Z stdout X x\n",
    "bad-time": "yesterday stdout F x\n",
    "no-newline": "2026-11-21T10:49:26+02:00 stdout F tail",
    "output-lines": "\x05line one\nline two that is longer\n\n",
    "output-long": "\x03" + "x" * 40 + "\n" + "y" * 7,
}
for name, text in logs.items():
    put("cri_log", name, text)

# --- layer_apply -------------------------------------------------------------------------------


def tar_of(entries, fmt=tarfile.PAX_FORMAT):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for e in entries:
            kind, name = e[0], e[1]
            info = tarfile.TarInfo(name)
            info.mtime = 1_600_000_000
            data = b""
            if kind == "dir":
                info.type, info.mode = tarfile.DIRTYPE, 0o755
            elif kind == "file":
                data = e[2]
                info.size, info.mode = len(data), 0o644
            elif kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, e[2]
            elif kind == "link":
                info.type, info.linkname = tarfile.LNKTYPE, e[2]
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
            if len(e) > 3:
                info.pax_headers = e[3]
            t.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def header(name, typeflag, size, extra=b"", magic=b"ustar\x0000", fields=None):
    h = bytearray(512)
    h[0:len(name)] = name
    h[100:108] = b"0000644\x00"
    h[108:116] = b"0000000\x00"
    h[116:124] = b"0000000\x00"
    h[124:136] = b"%011o\x00" % size
    h[136:148] = b"%011o\x00" % 1_600_000_000
    h[156] = typeflag
    h[257:265] = magic
    for at, val in (fields or {}).items():
        h[at:at + len(val)] = val
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\x00 " % sum(h)
    return bytes(h)


def pad(data):
    return data + b"\x00" * (-len(data) % 512)


def pax_record(k, v):
    body = b" " + k + b"=" + v + b"\n"
    n = len(body) + 1
    while len(str(n)) + len(body) != n:
        n = len(str(n)) + len(body)
    return str(n).encode() + body


END = b"\x00" * 1024
layers = {
    "basic-pax": tar_of([("dir", "etc"), ("file", "etc/passwd", b"root:x:0:0\n"),
                         ("sym", "bin", "usr/bin"), ("dir", "usr"), ("dir", "usr/bin"),
                         ("file", "usr/bin/sh", b"#!"), ("link", "usr/bin/ash", "usr/bin/sh")]),
    "gnu-longname": tar_of([("file", "d/" + "n" * 150, b"long")], fmt=tarfile.GNU_FORMAT),
    "ustar": tar_of([("dir", "a"), ("file", "a/b", b"x" * 600)], fmt=tarfile.USTAR_FORMAT),
    "whiteouts": tar_of([("dir", "a"), ("file", "a/x", b"1"), ("file", "a/.wh.x", b""),
                         ("file", "a/.wh..wh..opq", b""), ("file", ".wh.gone", b"")]),
    "xattrs": tar_of([("file", "f", b"x", {"SCHILY.xattr.user.k": "v", "mtime": "1.5"})]),
    "devices": tar_of([("fifo", "p"), ("chr", "null")]),
    "symlink-out": tar_of([("sym", "l", "/etc"), ("file", "l/pwned", b"x")]),
    "symlink-climb": tar_of([("sym", "l", "../../.."), ("file", "l/pwned", b"x")]),
    "dotdot": tar_of([("file", "../escape", b"x")]),
    "absolute": tar_of([("file", "/abs", b"x")]),
    "hardlink-out": tar_of([("link", "h", "../outside/file")]),
    "dir-then-symlink": tar_of([("dir", "a"), ("dir", "a/b"), ("sym", "a", "../outside")]),
    "replace-types": tar_of([("dir", "x"), ("file", "x", b"f"), ("dir", "x"), ("sym", "x", "y")]),
    "root-entry": tar_of([("dir", "./"), ("file", "./f", b"f")]),
    "empty": END,
    "truncated": tar_of([("file", "f", b"x" * 2000)])[:1200],
    "trailing-garbage": tar_of([("file", "f", b"x")]) + b"garbage",
    "huge-pax-size": header(b"PaxHeader", ord("x"), 100 << 20) + b"a" * 512,
    "huge-longname": header(b"././@LongLink", ord("L"), 1 << 30, magic=b"ustar  \x00"),
    "pax-bad-record": header(b"P", ord("x"), 8) + pad(b"99 a=b\n\x00") + header(b"f", ord("0"), 0) + END,
    "pax-size": header(b"P", ord("x"), 12) + pad(pax_record(b"size", b"3")) + header(b"f", ord("0"), 0)
    + pad(b"abc") + END,
    "base256-size": header(b"f", ord("0"), 0, fields={124: b"\x80" + b"\x00" * 10 + b"\x05"}) + pad(b"12345") + END,
    "global-header": header(b"g", ord("g"), 20) + pad(pax_record(b"comment", b"hello")) + tar_of([("file", "f", b"x")]),
}
# GNU old sparse: two segments in a 1 MiB file.
gnu = header(b"sparse", ord("S"), 1024, magic=b"ustar  \x00", fields={
    386: b"%011o\x00" % 4096 + b"%011o\x00" % 512,
    410: b"%011o\x00" % (1 << 19) + b"%011o\x00" % 512,
    483: b"%011o\x00" % (1 << 20),
})
layers["gnu-sparse"] = gnu + b"A" * 512 + b"B" * 512 + END
gnu_ext = header(b"sparse", ord("S"), 512, magic=b"ustar  \x00", fields={
    386: b"%011o\x00" % 0 + b"%011o\x00" % 0, 482: b"\x01", 483: b"%011o\x00" % 9000,
})
ext = bytearray(512)
ext[0:24] = b"%011o\x00" % 8192 + b"%011o\x00" % 512
layers["gnu-sparse-ext"] = gnu_ext + bytes(ext) + b"C" * 512 + END
# PAX sparse 0.1 and 1.0.
p01 = b"".join(pax_record(k, v) for k, v in [(b"GNU.sparse.size", b"65536"), (b"GNU.sparse.numblocks", b"1"),
                                             (b"GNU.sparse.map", b"4096,100")])
layers["pax-sparse-01"] = header(b"P", ord("x"), len(p01)) + pad(p01) + header(b"s", ord("0"), 100) + pad(b"D" * 100) + END
p10 = b"".join(pax_record(k, v) for k, v in [(b"GNU.sparse.major", b"1"), (b"GNU.sparse.minor", b"0"),
                                             (b"GNU.sparse.name", b"real"), (b"GNU.sparse.realsize", b"100000")])
m10 = pad(b"1\n50000\n10\n") + b"E" * 10
layers["pax-sparse-10"] = header(b"P", ord("x"), len(p10)) + pad(p10) + header(b"GNUSparseFile.1/real", ord("0"), len(m10)) + pad(m10) + END


def near_misses(key):
    """Keys that a byte-by-byte comparison with `key` rejects at each step: every proper prefix,
    `key` plus a byte, and `key` with each byte changed."""
    out = [key[:n] for n in range(1, len(key))] + [key + b"x"]
    out += [key[:i] + bytes([key[i] ^ 1]) + key[i + 1:] for i in range(len(key))]
    return out


def pax_entry(records, entry=None):
    body = b"".join(pax_record(k, v) for k, v in records)
    entry = entry or header(b"f", ord("0"), 0)
    return header(b"P", ord("x"), len(body)) + pad(body) + entry


# Keys next to the ones the reader knows (the session-21 fuzz round took 2 h to find these
# branches of the key comparisons by mutation), each family before a plain entry.
plain_keys = [b"path", b"linkpath", b"size", b"uid", b"gid", b"mtime"]
layers["pax-key-near-misses"] = pax_entry([(k, b"1") for pk in plain_keys for k in near_misses(pk)]) + END
sparse_keys = [b"major", b"minor", b"name", b"realsize", b"size", b"numblocks", b"map", b"offset", b"numbytes"]
layers["pax-sparse-key-near-misses"] = pax_entry(
    [(b"GNU.sparse." + k, b"1") for sk in sparse_keys for k in near_misses(sk)]
    + [(k, b"1") for k in near_misses(b"GNU.sparse.")]) + END
# Every key twice (the later value replaces the earlier one, which is dropped), before a header
# with a name and link name of its own for the PAX ones to replace (the eighth round's last find,
# 95 minutes in, was a second `linkpath`).
layers["pax-keys-twice"] = pax_entry(
    [(k, v) for k, v in [(b"path", b"p"), (b"linkpath", b"l"), (b"size", b"0"), (b"uid", b"1"),
                         (b"gid", b"1"), (b"mtime", b"1.5"), (b"SCHILY.xattr.user.a", b"v")]
     for _ in range(2)],
    header(b"own-name", ord("2"), 0, fields={157: b"own-link"})) + END
layers["pax-sparse-keys-twice"] = pax_entry(
    [(b"GNU.sparse." + k, v) for k, v in [(b"major", b"1"), (b"minor", b"0"), (b"name", b"n"),
                                          (b"realsize", b"10"), (b"size", b"10"), (b"numblocks", b"1"),
                                          (b"map", b"0,1")] for _ in range(2)]
    + [(b"GNU.sparse.offset", b"0"), (b"GNU.sparse.offset", b"1")]) + END
# Overlay's own xattrs are dropped; names around that prefix are kept.
layers["pax-overlay-xattrs"] = pax_entry(
    [(b"SCHILY.xattr.trusted.overlay." + s, b"y") for s in (b"opaque", b"origin", b"")]
    + [(b"SCHILY.xattr." + k, b"v") for k in near_misses(b"trusted.overlay.")]
    + [(k + b"user.a", b"v") for k in near_misses(b"SCHILY.xattr.")]) + END
# A PAX size before each kind of extension header: the size is the entry's, not the extension's.
size3 = pax_record(b"size", b"3")
for flag in b"xgLK":
    ext_body = pax_record(b"comment", b"c") if flag in b"xg" else b"longname"
    ext = header(b"E", flag, len(ext_body), magic=b"ustar  \x00" if flag in b"LK" else b"ustar\x0000")
    layers["pax-size-then-" + chr(flag)] = (header(b"P", ord("x"), len(size3)) + pad(size3) + ext
                                             + pad(ext_body) + header(b"f", ord("0"), 0) + pad(b"abc") + END)
# Every typeflag the reader names, and some it does not, as one-entry layers.
for flag in b"01234567SDMNVAZ\x00\xff":
    link = {ord("1"): b"h0", ord("2"): b"t"}.get(flag, b"")
    first = header(b"h0", ord("0"), 0) if flag == ord("1") else b""
    layers["typeflag-%02x" % flag] = first + header(b"e", flag, 0, fields={157: link}) + END
# Whiteouts of what the same layer wrote: a file, a symlink, a directory with contents, a
# directory's child, and the opaque marker after the directory's own files.
layers["whiteout-own"] = tar_of([("file", "f", b"1"), ("file", ".wh.f", b""),
                                 ("sym", "s", "f"), ("file", ".wh.s", b""),
                                 ("dir", "d"), ("file", "d/x", b"1"), ("dir", "d/e"), ("file", "d/e/y", b"2"),
                                 ("file", ".wh.d", b""), ("dir", "o"), ("file", "o/z", b"1"),
                                 ("file", "o/.wh..wh..opq", b""), ("file", "o/.wh.z", b""),
                                 ("file", ".wh.missing", b""), ("file", "o/.wh.", b"")])
for name, data in layers.items():
    assert len(data) < 64 * 1024, name
    put("layer_apply", name, data)

# --- spdy_frames, spdy_conn --------------------------------------------------------------------
# Client sessions as kubectl writes them: header blocks compressed as ONE zlib stream per
# direction with the SPDY/3 dictionary (runtime/src/stream/spdy/headers.rs), sync-flushed per block.
import struct
import zlib

SPDY_WORDS = ['options', 'head', 'post', 'put', 'delete', 'trace', 'accept', 'accept-charset', 'accept-encoding', 'accept-language', 'accept-ranges', 'age', 'allow', 'authorization', 'cache-control', 'connection', 'content-base', 'content-encoding', 'content-language', 'content-length', 'content-location', 'content-md5', 'content-range', 'content-type', 'date', 'etag', 'expect', 'expires', 'from', 'host', 'if-match', 'if-modified-since', 'if-none-match', 'if-range', 'if-unmodified-since', 'last-modified', 'location', 'max-forwards', 'pragma', 'proxy-authenticate', 'proxy-authorization', 'range', 'referer', 'retry-after', 'server', 'te', 'trailer', 'transfer-encoding', 'upgrade', 'user-agent', 'vary', 'via', 'warning', 'www-authenticate', 'method', 'get', 'status', '200 OK', 'version', 'HTTP/1.1', 'url', 'public', 'set-cookie', 'keep-alive', 'origin']
SPDY_TAIL = '100101201202205206300302303304305306307402405406407408409410411412413414415416417502504505203 Non-Authoritative Information204 No Content301 Moved Permanently400 Bad Request401 Unauthorized403 Forbidden404 Not Found500 Internal Server Error501 Not Implemented503 Service UnavailableJan Feb Mar Apr May Jun Jul Aug Sept Oct Nov Dec 00:00:00 Mon, Tue, Wed, Thu, Fri, Sat, Sun, GMTchunked,text/html,image/png,image/jpg,image/gif,application/xml,application/xhtml+xml,text/plain,text/javascript,publicprivatemax-age=gzip,deflate,sdchcharset=utf-8charset=iso-8859-1,utf-,*,enq=0.'
SPDY_DICT = b"".join(struct.pack(">I", len(w)) + w.encode() for w in SPDY_WORDS) + SPDY_TAIL.encode()
assert len(SPDY_DICT) == 1423, len(SPDY_DICT)


class Session:
    def __init__(self):
        self.z = zlib.compressobj(zdict=SPDY_DICT)
        self.out = b""

    def block(self, pairs):
        raw = struct.pack(">I", len(pairs))
        for k, v in pairs:
            raw += struct.pack(">I", len(k)) + k.encode() + struct.pack(">I", len(v)) + v.encode()
        return self.z.compress(raw) + self.z.flush(zlib.Z_SYNC_FLUSH)

    def control(self, ftype, flags, payload):
        self.out += struct.pack(">HHI", 0x8003, ftype, (flags << 24) | len(payload)) + payload
        return self

    def syn(self, sid, pairs, flags=0):
        return self.control(1, flags, struct.pack(">IIBB", sid, 0, 0, 0) + self.block(pairs))

    def headers(self, sid, pairs, flags=0):
        return self.control(8, flags, struct.pack(">I", sid) + self.block(pairs))

    def data(self, sid, payload, flags=0):
        self.out += struct.pack(">II", sid, (flags << 24) | len(payload)) + payload
        return self


exec_streams = [("error", 1), ("stdin", 3), ("stdout", 5), ("stderr", 7)]
s = Session()
s.control(4, 0, struct.pack(">III", 1, 7, 1 << 20))  # SETTINGS: initial window 1 MiB
for name, sid in exec_streams:
    s.syn(sid, [("streamtype", name)])
s.data(3, b"echo hello\n").data(3, b"", 1).control(6, 0, struct.pack(">I", 1))
s.control(9, 0, struct.pack(">II", 5, 4096)).control(9, 0, struct.pack(">II", 0, 65536))
s.control(3, 0, struct.pack(">II", 7, 5)).control(7, 0, struct.pack(">II", 7, 0))
spdy = {"exec-session": s.out}
s = Session()
s.syn(1, [("streamtype", "error"), ("port", "80"), ("requestid", "0")])
s.syn(3, [("streamtype", "data"), ("port", "80"), ("requestid", "0")])
s.data(3, b"GET / HTTP/1.0\r\n\r\n").headers(3, [("x", "y")], 1).data(1, b"", 1)
spdy["portforward-session"] = s.out
s = Session()
s.syn(1, [("streamtype", "resize")]).data(1, b'{"Width":80,"Height":24}\n')
s.syn(2, [("streamtype", "stdout")]).syn(1, [("streamtype", "again")])
s.syn(5, [("streamtype", "x")], flags=1).data(5, b"after fin").data(9, b"never opened")
s.control(9, 0, struct.pack(">II", 0, 0x7fffffff)).control(9, 0, struct.pack(">II", 0, 0x7fffffff))
spdy["protocol-errors"] = s.out
s = Session()
s.control(2, 0, struct.pack(">I", 1) + s.block([("a", "b")])).control(99, 0, b"skipped")
s.control(4, 0, struct.pack(">I", 2) + struct.pack(">II", 7, 0) + struct.pack(">II", 4, 10))
s.out += struct.pack(">HHI", 0x8002, 1, 0)  # SPDY/2
spdy["odd-frames"] = s.out
# A header block that inflates far past what it costs to send.
z = zlib.compressobj(zdict=SPDY_DICT)
bomb = z.compress(struct.pack(">I", 1) + struct.pack(">I", 1) + b"a" + struct.pack(">I", 3 << 20) + b"v" * (3 << 20))
bomb += z.flush(zlib.Z_SYNC_FLUSH)
spdy["inflation-bomb"] = struct.pack(">HHI", 0x8003, 1, len(bomb) + 10) + struct.pack(">IIBB", 1, 0, 0, 0) + bomb
for name, data in spdy.items():
    assert len(data) < 64 * 1024, name
    put("spdy_frames", name, data)
    put("spdy_conn", name, data)

# --- www_authenticate --------------------------------------------------------------------------
# Header values (one per line), then NUL-separated parts of a challenge to write and read back.
challenges = {
    "docker-hub": 'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/busybox:pull"',
    "basic": 'Basic realm="Registry Realm"',
    "two-in-one": 'Basic realm="x", Bearer realm=https://t.example/token,service=reg',
    "quoted-escapes": 'Bearer realm="a \\"q\\" b,c",scope="repository:a/b:pull,push"',
    "lines": 'Negotiate\nBearer realm="r"\nBasic',
    "token68": "Bearer abc==,",
    "garbage": '==,, "x"=y\tBearer realm="unterminated',
    "parts": "Bearer\0https://t.example/token\0reg\0repository:a:pull",
    "parts-quotes": 'Bearer\0a "b" \\ c, d\0\0scope',
}
for name, data in challenges.items():
    put("www_authenticate", name, data)

print("seeds written to", CORPUS)
