"""TorchServe for the device machine, which has no Java and no network (issue 59 item 5).

``pack`` (run here by ``make gpu-wheels``) writes into ``--out`` (``.whl-serve/``, which ``make gpu-check``'s
device call carries beside ``.whl/``, 64 MiB in all):

- ``java-runtime.tar.xz``: a Java runtime made with ``jlink`` from a JDK of version 24 or later (those
  link from their own run-time image, JEP 493; Debian's Java 17 ships no ``jmods`` to link from), of
  :data:`JAVA_MODULES` only, without debug symbols, man pages or headers (about 22 MB);
- ``torchserve-frontend.tar.xz``: the entries of TorchServe's frontend jar (``ts/frontend/model-server.jar``),
  uncompressed inside the ``.tar.xz`` (xz over the class files is about half the size of the jar's own
  deflate: about 20 MB against 46 MB);
- the ``torchserve`` wheel without that jar, and the ``torch-model-archiver`` wheel.

``unpack`` (on the device machine, ``benchmarks/gpu_check.sh``, after the wheels are installed into
``--site``) puts the runtime at ``--java`` (its programs executable again: without the run bit of
``lib/jspawnhelper`` every worker start fails with ``posix_spawn failed, error 13``) and writes the jar
back into ``--site``'s ``ts/frontend``. Then ``JAVA_HOME=<java>``: TorchServe's launcher runs
``$JAVA_HOME/bin/java`` (``ts/model_server.py``). TorchServe 0.12 runs on Java 25 (deprecation warnings only).

Usage:
    python benchmarks/gpu_bundle.py pack --out .whl-serve [--jdk /usr/lib/jvm/temurin-25-jdk-amd64]
    python benchmarks/gpu_bundle.py unpack --bundle .whl-serve --site /tmp/site --java /tmp/java
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

#: The modules TorchServe 0.12's frontend needs (``java.desktop``: it uses ``java.beans``).
JAVA_MODULES = (
    "java.base,java.compiler,java.desktop,java.logging,java.management,java.naming,java.rmi,"
    "java.scripting,java.sql,java.xml,jdk.unsupported,jdk.crypto.ec,jdk.zipfs"
)
JAVA_TAR = "java-runtime.tar.xz"
FRONTEND_TAR = "torchserve-frontend.tar.xz"
#: The frontend jar's path inside the torchserve wheel and an installed site.
JAR = "ts/frontend/model-server.jar"
TORCHSERVE = "torchserve==0.12.0"
ARCHIVER = "torch-model-archiver==0.12.0"


def find_jdk() -> Path:
    """The newest JDK under ``/usr/lib/jvm`` (or ``$JAVA_LINK_HOME``) of version 24 or later with ``jlink``.

    Raises:
        SystemExit: none found (name one with ``--jdk``).
    """
    named = os.environ.get("JAVA_LINK_HOME")
    candidates = [Path(named)] if named else sorted(Path("/usr/lib/jvm").glob("*"), key=_version, reverse=True)
    for home in candidates:
        if (home / "bin" / "jlink").exists() and _version(home) >= 24:
            return home
    raise SystemExit("no JDK >= 24 with jlink under /usr/lib/jvm; name one with --jdk (e.g. Temurin 25)")


def _version(home: Path) -> int:
    """The feature version of the JDK at ``home`` (its ``release`` file's JAVA_VERSION), 0 if unknown."""
    release = home / "release"
    found = re.search(r'JAVA_VERSION="(\d+)', release.read_text()) if release.exists() else None
    return int(found.group(1)) if found else 0


def pack_java(jdk: Path, out: Path) -> Path:
    """``jlink`` a runtime of :data:`JAVA_MODULES` from ``jdk`` and write it as ``out/java-runtime.tar.xz``
    (one top folder, ``java``)."""
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "java"
        command = [str(jdk / "bin" / "jlink"), "--add-modules", JAVA_MODULES, "--strip-debug", "--no-man-pages"]
        subprocess.run([*command, "--no-header-files", "--output", str(runtime)], check=True)
        target = out / JAVA_TAR
        with tarfile.open(target, "w:xz") as tar:
            tar.add(runtime, arcname="java")
    return target


def pack_torchserve(out: Path) -> list[Path]:
    """Download the torchserve and torch-model-archiver wheels into ``out``, torchserve's split by
    :func:`split_wheel`; returns the files written."""
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", tmp]
        subprocess.run([*pip, TORCHSERVE, ARCHIVER], check=True)
        archiver = next(Path(tmp).glob("torch_model_archiver-*.whl"))
        shutil.copy(archiver, out / archiver.name)
        return [*split_wheel(next(Path(tmp).glob("torchserve-*.whl")), out), out / archiver.name]


def split_wheel(wheel: Path, out: Path) -> list[Path]:
    """Write the torchserve ``wheel`` into ``out`` without its frontend jar (the jar's RECORD line gone),
    and the jar's entries as ``out/torchserve-frontend.tar.xz``; returns both paths.

    Raises:
        KeyError: the wheel has no :data:`JAR`.
    """
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out / wheel.name, "w", zipfile.ZIP_DEFLATED) as dst:
        _jar_to_tar(src.read(JAR), out / FRONTEND_TAR)
        for info in src.infolist():
            if info.filename == JAR:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if not line.startswith(JAR + ",")).encode()
            dst.writestr(info, data)
    return [out / wheel.name, out / FRONTEND_TAR]


def _jar_to_tar(jar: bytes, target: Path) -> None:
    """Write the entries of ``jar`` (a zip), in its order, uncompressed into the ``.tar.xz`` ``target``."""
    with zipfile.ZipFile(io.BytesIO(jar)) as z, tarfile.open(target, "w:xz") as tar:
        for info in z.infolist():
            entry = tarfile.TarInfo(info.filename.rstrip("/"))
            if info.is_dir():
                entry.type = tarfile.DIRTYPE
                tar.addfile(entry)
                continue
            data = z.read(info)
            entry.size = len(data)
            tar.addfile(entry, io.BytesIO(data))


def unpack(bundle: Path, site: Path, java: Path) -> None:
    """Put the Java runtime at ``java`` (programs executable) and the frontend jar into ``site``'s
    ``ts/frontend`` (the torchserve wheel installed there first).

    Raises:
        FileNotFoundError: ``bundle`` lacks a part, or ``site`` has no ``ts`` package.
    """
    if not (site / "ts").is_dir():
        raise FileNotFoundError(f"{site}/ts: install the torchserve wheel into {site} first")
    java.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle / JAVA_TAR) as tar:
        for member in tar.getmembers():
            if member.name == "java" or not member.name.startswith("java/"):
                continue
            member.name = member.name.removeprefix("java/")
            tar.extract(member, java, filter="tar")
    for program in [*(java / "bin").iterdir(), *(java / "lib").glob("jspawnhelper")]:
        program.chmod(0o755)
    (site / JAR).parent.mkdir(exist_ok=True)
    with tarfile.open(bundle / FRONTEND_TAR) as tar, zipfile.ZipFile(site / JAR, "w", zipfile.ZIP_STORED) as jar:
        for member in tar:
            if member.isdir():
                jar.writestr(member.name + "/", b"")
                continue
            handle = tar.extractfile(member)
            assert handle is not None  # a regular file
            jar.writestr(member.name, handle.read())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    pack = sub.add_parser("pack", help="write the Java runtime, the frontend and the wheels into --out")
    pack.add_argument("--out", default=".whl-serve")
    pack.add_argument("--jdk", default=None, help="a JDK >= 24 (default: the newest under /usr/lib/jvm)")
    put = sub.add_parser("unpack", help="on the device machine: the runtime at --java, the jar into --site")
    put.add_argument("--bundle", default=".whl-serve")
    put.add_argument("--site", default="/tmp/site")
    put.add_argument("--java", default="/tmp/java")
    args = ap.parse_args(argv)
    if args.command == "unpack":
        unpack(Path(args.bundle), Path(args.site), Path(args.java))
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = [pack_java(Path(args.jdk) if args.jdk else find_jdk(), out), *pack_torchserve(out)]
    for path in written:
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
