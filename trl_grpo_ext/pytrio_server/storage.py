"""The storage folder as the server reads and writes it: a folder a second server, or other users of the machine, may
share, so nothing in it is trusted for its name or its content alone.

- `StorageKey`: the storage folder's secret (`KEY_FILE` in its root: a regular file of the server's user, readable by
  that user only) that signs every checkpoint record. Servers on one folder share it: the first one creates it,
  the others read it.
- `CheckpointFolder`: a folder of the layout the server writes (``<root>/<run>/<weights|sampler_weights>/<name>``),
  reached one directory at a time without following a symbolic link, each directory the server user's own; its files
  are read only when they are regular files of that user (`UnsafeEntry` otherwise).
- `remove_checkpoint_folder`: a delete that removes exactly one checkpoint folder, after the caller checked what is in
  it, and follows no link on the way or inside.

Messages of `StorageError` may name paths on the server's disk: they go to the server's log or to the operator's
terminal, never into an answer to a client.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

KEY_FILE = ".trio_storage_key"  # in the storage root: hidden, so no scan of the layout takes it for a run
RECORD_FILE = "trio_record.json"  # a checkpoint's record, written last (its presence = complete)
ADAPTER_FILE = "adapter_model.safetensors"  # a checkpoint's LoRA weights (`adapters.LoraSnapshot`)
_KEY_HEX = 64  # 32 random bytes, hex
_KEY_WAIT_SECONDS = 5.0  # a key file another server is writing (created, its line not yet written)
_SIGNATURE = re.compile(r"hmac-sha256:[0-9a-f]{64}")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# Opening a file to read: a FIFO planted under a file's name would block an open without O_NONBLOCK until someone
# writes to it (O_NONBLOCK changes nothing for a regular file); the regular-file check follows the open (fstat)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC
# One name of the layout: no separator, not "." or "..", nothing the OS would read as more than one entry.
_PART = re.compile(r"[A-Za-z0-9_.\-]{1,255}")
# /proc/self/fd/N names the very file or folder descriptor N holds, whatever happens to its path meanwhile
_PROC_FD = Path("/proc/self/fd")


class StorageError(Exception):
    """The storage folder holds something the server refuses (one line, for the log or the operator)."""


class UnsafeEntry(StorageError):
    """An entry of the layout that is not what the server writes there: a symbolic link, a file where a folder belongs
    (or the reverse), another user's file or folder, a file larger than its kind can be."""


# ---------------------------------------------------------------------------------------------------- the key
class StorageKey:
    """The secret that signs checkpoint records (HMAC-SHA256 over the record's fields, `sign`)."""

    def __init__(self, secret: bytes):
        self._secret = secret

    @classmethod
    def of(cls, root: Path) -> StorageKey:
        """The key of the storage folder `root`, created there (0600) when it has none; `StorageError` (one line
        saying what to do) for a key file that is a link, another user's, readable by others or malformed."""
        try:
            root_fd = os.open(root, _DIRECTORY)
            try:
                try:
                    return cls(_read_key(root_fd, root / KEY_FILE))
                except FileNotFoundError:
                    pass
                try:
                    return cls(_create_key(root_fd))
                except FileExistsError:  # another server on this folder made it first: theirs is the folder's key
                    return cls(_read_key(root_fd, root / KEY_FILE))
            finally:
                os.close(root_fd)
        except OSError as error:
            raise StorageError(f"cannot read or create the storage key {root / KEY_FILE}: {error.strerror}") from None

    def sign(self, fields: dict) -> str:
        digest = hmac.new(self._secret, b"trio-checkpoint-record\0" + _canonical(fields), hashlib.sha256)
        return f"hmac-sha256:{digest.hexdigest()}"

    def verify(self, fields: dict, signature: object) -> bool:
        """Whether `signature` is this key's over `fields` (anything malformed is simply not)."""
        if not isinstance(signature, str) or not _SIGNATURE.fullmatch(signature):
            return False
        try:
            expected = self.sign(fields)
        except (ValueError, TypeError, RecursionError, OverflowError):  # NaN, nesting deeper than JSON writes out
            return False  # nothing this key signed: `sign` never wrote such fields
        return hmac.compare_digest(signature, expected)


def _canonical(fields: dict) -> bytes:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _create_key(root_fd: int) -> bytes:
    """A new key in `KEY_FILE`, created exclusively (a second server on the folder reads it instead)."""
    fd = os.open(KEY_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=root_fd)
    text = secrets.token_hex(_KEY_HEX // 2)
    try:
        os.write(fd, f"{text}\n".encode())
        os.fsync(fd)
    except BaseException:
        # a key file left empty would refuse every later start: remove it (if it still is the one made here)
        with contextlib.suppress(OSError):
            if os.stat(KEY_FILE, dir_fd=root_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(KEY_FILE, dir_fd=root_fd)
        raise
    finally:
        os.close(fd)
    logger.info("storage key created (%s): it signs this folder's checkpoint records", KEY_FILE)
    return bytes.fromhex(text)


def _read_key(root_fd: int, path: Path) -> bytes:
    deadline = time.monotonic() + _KEY_WAIT_SECONDS
    while True:
        try:
            fd = os.open(KEY_FILE, _READ, dir_fd=root_fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise StorageError(
                    f"refusing the storage key {path}: it is a symbolic link, not a file a server wrote; remove it "
                    "(a new key is made, and checkpoints signed with the old one are refused)"
                ) from None
            raise
        try:
            info = os.fstat(fd)
            problem = _key_file_problem(info)
            if problem:
                raise StorageError(f"refusing the storage key {path}: {problem}")
            text = os.read(fd, _KEY_HEX + 2).decode("ascii", errors="replace").strip()
        finally:
            os.close(fd)
        if re.fullmatch(rf"[0-9a-f]{{{_KEY_HEX}}}", text):
            return bytes.fromhex(text)
        # empty or a beginning of a key: another server created it and is writing it (servers starting together);
        # anything else holds no key however long one waits
        if not re.fullmatch(rf"[0-9a-f]{{0,{_KEY_HEX - 1}}}", text) or time.monotonic() >= deadline:
            raise StorageError(
                f"refusing the storage key {path}: it does not hold a key ({_KEY_HEX} hex digits); remove it (a new "
                "key is made, and checkpoints signed with the old one are refused)"
            )
        time.sleep(0.05)  # created by another server that has not written it yet


def _key_file_problem(info: os.stat_result) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != os.geteuid():
        return (
            f"it belongs to uid {info.st_uid}, not to this server's user (uid {os.geteuid()}); servers sharing a "
            "storage folder must run as one user"
        )
    if info.st_mode & 0o077:
        mode = oct(stat.S_IMODE(info.st_mode))
        return (
            f"users other than this server's can read or change it (mode {mode}): whoever read it can forge "
            "checkpoint records. chmod 600 it if no one else did, or remove it (a new key is made, and checkpoints "
            "signed with the old one are refused)"
        )
    return None


def prepare_root(root: Path) -> None:
    """Create the storage folder `root` (readable by the server's user only) if it is missing; warn when other users
    may write into it (they cannot forge a record, but can delete or damage checkpoints)."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = root.stat()
    if info.st_mode & 0o022:
        logger.warning(
            "the storage folder %s is writable by other users (mode %s): they cannot forge a checkpoint record, but "
            "they can delete or damage checkpoints; chmod go-w it if it is this server's alone",
            root, oct(stat.S_IMODE(info.st_mode)),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------------- folders
def _check_part(part: str) -> None:
    if not _PART.fullmatch(part) or part in (".", ".."):
        raise UnsafeEntry(f"{part!r} is not a name of the storage layout")


def _open_child(parent_fd: int, part: str, where: Path) -> int:
    """The folder `part` of `parent_fd`, opened without following a link; it must be the server user's."""
    _check_part(part)
    try:
        fd = os.open(part, _DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeEntry(f"{where / part} is not a folder (a symbolic link or a file)") from None
        raise
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeEntry(f"{where / part} belongs to another user")
    return fd


def open_chain(root: Path, parts: tuple[str, ...], create: bool = False) -> int:
    """A descriptor of ``root/part/...``, each part opened without following a link (`UnsafeEntry` for a link, a
    file or another user's folder; FileNotFoundError for a missing one). With `create`, missing parts are made
    (mode 0700). The root itself is the operator's choice and may be a link."""
    fd = os.open(root, _DIRECTORY)
    where = root
    try:
        for part in parts:
            if create:
                _check_part(part)
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o700, dir_fd=fd)
            child = _open_child(fd, part, where)
            os.close(fd)
            fd, where = child, where / part
        return fd
    except BaseException:
        os.close(fd)
        raise


class CheckpointFolder:
    """A folder of the layout, held open (`open_chain`): files are read, written and removed relative to it, so a
    link or a renamed folder on its path cannot send them elsewhere. A context manager; `close` releases it."""

    def __init__(self, root: Path, parts: tuple[str, ...], create: bool = False):
        self.path = root.joinpath(*parts)  # for the server's log only
        self.fd = open_chain(root, parts, create)

    def __enter__(self) -> CheckpointFolder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def pinned(self) -> Path:
        """A path of this very folder for libraries that take paths (``/proc/self/fd/N`` where there is one)."""
        proc = _PROC_FD / str(self.fd)
        return proc if _PROC_FD.is_dir() else self.path

    def child(self, name: str) -> CheckpointFolder:
        """The folder `name` inside this one (same checks)."""
        folder = CheckpointFolder.__new__(CheckpointFolder)
        folder.path = self.path / name
        folder.fd = _open_child(self.fd, name, self.path)
        return folder

    def entry(self, name: str) -> os.stat_result | None:
        """`name`'s own status (a link is not followed), or None when there is nothing of that name."""
        _check_part(name)
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    def _open_file(self, name: str, limit: int | None) -> tuple[int, int]:
        """(descriptor, size) of the regular file `name`, the server user's, at most `limit` bytes."""
        _check_part(name)
        try:
            fd = os.open(name, _READ, dir_fd=self.fd)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise UnsafeEntry(f"{self.path / name} is a symbolic link") from None
            raise
        info = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(info.st_mode):
            problem = "is not a regular file"
        elif info.st_uid != os.geteuid():
            problem = "belongs to another user"
        elif limit is not None and info.st_size > limit:
            problem = f"has {info.st_size} bytes, more than such a file can hold ({limit})"
        if problem:
            os.close(fd)
            raise UnsafeEntry(f"{self.path / name} {problem}")
        return fd, info.st_size

    def open(self, name: str, limit: int | None = None):
        """The regular file `name` opened for binary reading (`UnsafeEntry`, FileNotFoundError)."""
        fd, _ = self._open_file(name, limit)
        return os.fdopen(fd, "rb")

    def read(self, name: str, limit: int | None = None) -> bytes:
        with self.open(name, limit) as handle:
            return handle.read()

    @contextlib.contextmanager
    def file_path(self, name: str, limit: int | None = None) -> Iterator[Path]:
        """A path naming the checked regular file `name` itself (``/proc/self/fd/N``, so a library that opens paths,
        or maps them, reads exactly that file), for the duration of the block."""
        fd, _ = self._open_file(name, limit)
        try:
            proc = _PROC_FD / str(fd)
            yield proc if _PROC_FD.is_dir() else self.path / name
        finally:
            os.close(fd)

    def write_atomic(self, name: str, data: bytes) -> None:
        """Replace `name` with `data` at once (a temporary file, fsync, rename): a reader sees all or nothing."""
        _check_part(name)
        temporary = f".{name}.{secrets.token_hex(4)}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600,
                     dir_fd=self.fd)  # fmt: skip
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=self.fd)
            raise
        with contextlib.suppress(OSError):  # the rename itself survives a power loss
            os.fsync(self.fd)

    def remove(self, name: str) -> None:
        """Remove the entry `name`: a folder with what it holds (no link followed inside), anything else itself (a
        link is removed, never what it points to). Nothing there is nothing to do."""
        info = self.entry(name)
        if info is None:
            return
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(name, dir_fd=self.fd)
        else:
            os.unlink(name, dir_fd=self.fd)

    def rename(self, source: str, target: str) -> None:
        _check_part(source)
        _check_part(target)
        os.replace(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)


def remove_checkpoint_folder(
    root: Path, parts: tuple[str, str, str], check: Callable[[CheckpointFolder], bool]
) -> bool:
    """Delete the checkpoint folder ``root/run/kind/name`` (`parts`) when `check` (given the folder, opened) says it
    holds what the caller means to delete; returns whether it did. Its record goes first, so a delete cut short leaves
    a folder no server takes for a checkpoint. The root, a parent or anything a link points to is never deleted:
    `UnsafeEntry` for a link or a foreign entry on the way."""
    try:
        parent = CheckpointFolder(root, parts[:2])
    except FileNotFoundError:
        return False
    with parent:
        try:
            folder = parent.child(parts[2])
        except FileNotFoundError:
            return False
        with folder:
            if not check(folder):
                return False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(RECORD_FILE, dir_fd=folder.fd)
        shutil.rmtree(parts[2], dir_fd=parent.fd)
    return True


def scan_layout(root: Path, kind_folders: tuple[str, ...]) -> Iterator[tuple[str, str, str]]:
    """``(run, kind folder, name)`` of every folder of the layout under `root` that holds a `RECORD_FILE`, in name
    order; links, hidden entries (staging folders, the key) and names outside the layout are passed over."""

    def folders(path: Path) -> list[str]:
        try:
            with os.scandir(path) as entries:
                names = [e.name for e in entries if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")]
        except OSError:
            return []
        return sorted(n for n in names if _PART.fullmatch(n))

    for run in folders(root):
        for kind in folders(root / run):
            if kind not in kind_folders:
                continue
            for name in folders(root / run / kind):
                if (root / run / kind / name / RECORD_FILE).is_file():
                    yield run, kind, name
