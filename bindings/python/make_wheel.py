"""make_wheel.py - packs the built tdist package into a wheel (no setuptools, no network).

    make_wheel.py --version V --package build/python/tdist --library build/libtdist.so.X.Y.Z
                  --soname libtdist.so.X.Y --out build/python/dist

The wheel holds the package's modules, the cffi extension and a copy of libtdist under its soname
next to the extension (whose rpath starts with $ORIGIN), so a virtualenv needs nothing from the
build tree: `pip install build/python/dist/tdist-*.whl`. libtdist's own dependencies (gRPC,
protobuf-c, OpenBLAS, OpenSSL) come from the system, as for C programs. Run by the build
(bindings/python/CMakeLists.txt, target tdist_wheel).
"""
import argparse
import base64
import hashlib
import os
import sys
import sysconfig
import zipfile


def tags():
    impl = "cp%d%d" % sys.version_info[:2]
    abi = impl + getattr(sys, "abiflags", "")
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return impl, abi, plat


def record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (name, digest, len(data))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--version", required=True)
    ap.add_argument("--package", required=True)
    ap.add_argument("--library", required=True)
    ap.add_argument("--soname", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    impl, abi, plat = tags()
    name = "tdist-%s-%s-%s-%s.whl" % (a.version, impl, abi, plat)
    info = "tdist-%s.dist-info" % a.version
    files = []
    for f in sorted(os.listdir(a.package)):
        p = os.path.join(a.package, f)
        if f.endswith(".py") or (f.startswith("_tdist_cffi") and f.endswith(".so")):
            with open(p, "rb") as fh:  # follows the build tree's links to the sources
                files.append(("tdist/" + f, fh.read()))
    if not any(n.startswith("tdist/_tdist_cffi") for n, _ in files):
        sys.exit("make_wheel: no extension module in %s" % a.package)
    with open(a.library, "rb") as fh:
        files.append(("tdist/" + a.soname, fh.read()))
    metadata = "\n".join([
        "Metadata-Version: 2.1",
        "Name: tdist",
        "Version: " + a.version,
        "Summary: Python binding of tdist (torch.distributed-style RPC for C programs)",
        "Requires-Python: >=3.9",
        "Requires-Dist: cffi",
        "Requires-Dist: numpy",
        "",
    ]).encode()
    wheel = "\n".join([
        "Wheel-Version: 1.0",
        "Generator: tdist make_wheel.py",
        "Root-Is-Purelib: false",
        "Tag: %s-%s-%s" % (impl, abi, plat),
        "",
    ]).encode()
    files.append((info + "/METADATA", metadata))
    files.append((info + "/WHEEL", wheel))
    record = [record_line(n, d) for n, d in files] + [info + "/RECORD,,"]
    files.append((info + "/RECORD", ("\n".join(record) + "\n").encode()))
    os.makedirs(a.out, exist_ok=True)
    for old in os.listdir(a.out):  # one wheel: the current build's
        if old.startswith("tdist-") and old.endswith(".whl"):
            os.unlink(os.path.join(a.out, old))
    tmp = os.path.join(a.out, name + ".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files:
            zi = zipfile.ZipInfo(n, date_time=(2020, 1, 1, 0, 0, 0))
            zi.external_attr = (0o755 if n.endswith(".so") or ".so." in n else 0o644) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, d)
    os.replace(tmp, os.path.join(a.out, name))


if __name__ == "__main__":
    main()
