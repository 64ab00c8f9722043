"""Whether the probe's user was refused anything Python finds packages through.

An image cause is a fact about the image's files, the same for every user who runs it,
and it becomes a verdict for the image's digest, for every tenant. The probe runs as the
pod's user (``runAsUser``), and a user that may not read a package's folder, a ``.pth``
file or the user site-packages sees that package as absent: the import says ``No module
named 'mooncake.pg'``, the files "torch is not installed". So before a failure is said to
be the image's, this checks that nothing Python reads packages from was refused to this
user; if something was, the failure is this pod's (its user), never the image's.

What is checked, each under one budget of entries (:data:`MAX_ENTRIES`):

- every ``sys.path`` entry the child uses: searchable and listable;
- every ``.pth`` file in it: readable, and every folder it names reachable (``site``
  skips an unreadable ``.pth`` and a folder it cannot stat without a word);
- the user site-packages of the child's ``HOME`` (the child runs without ``-s``);
- every folder of the packages the probe imports or that they load (:data:`PACKAGES`)
  searchable, and every file the import reads (:data:`IMPORTED`) readable; of their
  dist-infos, the METADATA the files are judged from. A ``__pycache__`` is not needed
  (Python falls back to the source), nor a symlink that points nowhere (not for root
  either); a symlink to a folder must lead to one this user may enter.

Beside them, a missing library is checked against the loader's own search path
(:func:`refused_folder`): ``LD_LIBRARY_PATH``, the ``ld.so.conf`` folders and the
defaults.

Standard library only; Python 3.8 syntax (the probe runs in images we do not build).
"""

import os
import sys

try:
    from . import elf
except ImportError:  # run as `python3 probe`: the directory itself is on sys.path
    import elf

# Top-level names whose folders (and dist-infos) are walked: what the probe imports
# (mooncake, torch, sglang), what torch loads its CUDA libraries from (nvidia), and the
# torch companions its import reads (torchgen, functorch).
PACKAGES = ("mooncake", "torch", "sglang", "nvidia", "torchgen", "functorch")
# Entries looked at in all: a CUDA torch with its nvidia wheels holds ~20,000 files. Past
# this, what was not looked at is not reported (the walk says so in its result).
MAX_ENTRIES = 200000
MAX_PTH_BYTES = 1 << 20
# Entries of another user's site looked at for PACKAGES (another_users_site).
MAX_SITE_ENTRIES = 10000
# The files an import reads: sources, compiled modules and the shared libraries they
# load (``libfoo.so.12``), and what the probe reads of a dist-info.
IMPORTED = (".py", ".so", ".pyd", ".pth")
READ_IN_DIST_INFO = ("METADATA",)


class _Walk:
    def __init__(self, budget):
        self.budget = budget
        self.cut = False

    def spend(self):
        self.budget -= 1
        if self.budget < 0:
            self.cut = True
        return not self.cut


def _stat_refused(path):
    """True when this user may not even stat ``path`` (a folder above it refuses)."""
    try:
        os.stat(path)
    except PermissionError:
        return True
    except (OSError, ValueError):
        pass
    return False


def _dir_refused(path):
    return not os.access(path, os.R_OK | os.X_OK)


def _owned_name(name):
    """The top-level package a folder entry belongs to, if one of PACKAGES: the package
    folder itself, or its dist-info / egg-info (``mooncake_transfer_engine-0.3.13...``)."""
    low = name.lower()
    for pkg in PACKAGES:
        if low == pkg or low.startswith(pkg + "-") or low.startswith(pkg + "_"):
            return pkg
    return None


def _imported(name):
    return name.endswith(IMPORTED) or ".so." in name


def _walk_tree(top, walk):
    """The first folder or file the import needs under ``top`` that this user may not
    read; None when none."""
    dist_info = top.endswith((".dist-info", ".egg-info"))
    stack = [top]
    while stack and walk.spend():
        d = stack.pop()
        if _dir_refused(d):
            return d
        try:
            entries = list(os.scandir(d))
        except PermissionError:
            return d
        except OSError:
            continue
        for e in entries:
            if not walk.spend():
                return None
            try:
                if e.name == "__pycache__":
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                elif e.is_symlink() and e.is_dir(follow_symlinks=True):
                    if _dir_refused(e.path):  # entered, not walked (a loop is possible)
                        return e.path
                elif not os.path.exists(e.path):
                    continue  # points nowhere: the same for every user
                elif (e.name in READ_IN_DIST_INFO if dist_info else _imported(e.name)) and (
                    not os.access(e.path, os.R_OK)
                ):
                    return e.path
            except PermissionError:
                return e.path
            except OSError:
                continue
    return None


def _pth_targets(entry, name):
    """The folders a ``.pth`` file names (``site.addpackage``'s reading of it), from its
    first MAX_PTH_BYTES. Read only as a regular file, never blocking (a FIFO named ``zz.pth`` held
    the probe past its deadline: found by a review helper); the caller charges each
    folder to its walk's budget."""
    f = elf.open_regular(os.path.join(entry, name))
    if f is None:
        return []
    try:
        with f:
            data = f.read(MAX_PTH_BYTES)
    except OSError:
        return []
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line.startswith(("import ", "import\t")):
            continue
        out.append(os.path.join(entry, line))
    return out


def _venv_isolated():
    """This interpreter is a virtual environment without the system's site-packages: its
    ``site`` adds no user site-packages either."""
    if sys.prefix == getattr(sys, "base_prefix", sys.prefix):
        return False
    try:
        with open(os.path.join(sys.prefix, "pyvenv.cfg")) as f:
            text = f.read(65536)
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition("=")
        if key.strip().lower() == "include-system-site-packages":
            return value.strip().lower() != "true"
    return True


def user_site(environ):
    """The user site-packages the child (no ``-s``) would add, from its ``HOME``; None
    when it adds none (``PYTHONNOUSERSITE``, an isolated venv, a setuid process)."""
    if environ.get("PYTHONNOUSERSITE") or _venv_isolated():
        return None
    if hasattr(os, "geteuid") and (os.geteuid() != os.getuid() or os.getegid() != os.getgid()):
        return None
    base = environ.get("PYTHONUSERBASE") or (
        os.path.join(environ["HOME"], ".local") if environ.get("HOME") else None)
    if not base:
        return None
    version = "python{}.{}".format(*sys.version_info[:2])
    return os.path.join(base, "lib", version, "site-packages")


def user_site_of(home, environ):
    """The user site-packages a child with ``environ`` but HOME ``home`` would add (None:
    it adds none, whatever the HOME)."""
    return user_site(dict(environ, HOME=home))


def another_users_site(environ, homes, runtime_home, unknown_holds=False):
    """A user site-packages that holds one of PACKAGES, as (folder, its HOME), when which
    one the child adds depends on the pod's user; None when it does not.

    A child adds the user site of its HOME. Where the image sets no HOME, the runtime
    sets the user's own from /etc/passwd (``runtime_home``; ``/`` for a uid it does not
    name), so the packages found follow the pod's ``runAsUser``: an image whose packages
    sit in one user's site reads "torch is not installed" for any uid whose HOME is
    ``/``. ``homes``: every HOME a user of the image may have (inventory.user_homes). A
    HOME other than the runtime's, or PYTHONUSERBASE, was set by the image: the same for
    every user."""
    if environ.get("PYTHONUSERBASE") or environ.get("HOME") != runtime_home:
        return None
    for home in homes:
        site = user_site_of(home, environ)
        if site is not None and _holds_the_packages(site, unknown_holds):
            return site, home
    return None


def _holds_the_packages(folder, unknown_holds=False):
    """Does ``folder`` hold one of PACKAGES (a module folder or a dist-info of one)?
    Looks at MAX_SITE_ENTRIES entries at most (past them: it may, so it does). A folder
    that is not there holds nothing. One this user may not list (another user's 0700
    home, read by a uid without it, or by root without CAP_DAC_OVERRIDE as in a
    preflight), or whose name the system refuses (a NUL in a passwd HOME), is
    ``unknown_holds``: True before an absence is called the image's (read as "holds
    nothing", it made "torch is not installed" an image fact chosen by the pod's
    runAsUser: found by a review helper), False for a pass (this process imported
    nothing from a folder it cannot list; True there made every non-root pod's pass
    "usable in this pod", since /root is 0700: found by the next review)."""
    try:
        with os.scandir(folder) as entries:
            for seen, entry in enumerate(entries):
                if seen >= MAX_SITE_ENTRIES or entry.name.lower().startswith(PACKAGES):
                    return True
    except (FileNotFoundError, NotADirectoryError):
        return False
    except (OSError, ValueError):
        return unknown_holds
    return False


def refused_folder(folders):
    """The first of ``folders`` (the loader's search path) that exists and this user may
    not search; None when there is none. The loader skips such a folder for this user
    alone, so a library in it is "missing" for this pod only."""
    for folder in folders:
        if not folder:
            continue
        if _stat_refused(folder) or (os.path.isdir(folder) and _dir_refused(folder)):
            return folder
    return None


def refused(path, environ, budget=MAX_ENTRIES, deep=True):
    """(the first path this user may not read, whether the walk was cut by the budget)
    among the places in the module docstring; the path is None when there is none.

    ``deep=False``: the package folders themselves only, not what they hold: for a
    reading of the files (static.py), which notes every refusal it meets itself
    (files.Live.denied); a CUDA torch is ~16,000 entries, 0.1 s idle, much more on a
    busy node where a hundred preflights run at once."""
    walk = _Walk(budget)
    seen = set()
    entries = [p for p in path if p]
    home_site = user_site(environ)
    if home_site is not None:
        if _stat_refused(home_site):
            return home_site, False
        entries.append(home_site)
    for entry in entries:
        if entry in seen or not walk.spend():
            continue
        seen.add(entry)
        if _stat_refused(entry):
            return entry, False
        if not os.path.isdir(entry):
            continue  # a zip or a missing entry: nothing a user can be refused here
        if _dir_refused(entry):
            return entry, False
        try:
            names = sorted(os.listdir(entry))
        except PermissionError:
            return entry, False
        except OSError:
            continue
        for name in names:
            if not walk.spend():
                break
            full = os.path.join(entry, name)
            if name.endswith(".pth"):
                if _stat_refused(full):
                    return full, False
                if not os.path.exists(full):
                    continue  # a link to nothing: site skips it for every user
                if not os.access(full, os.R_OK):
                    return full, False
                for target in _pth_targets(entry, name):
                    if not walk.spend():
                        break
                    if _stat_refused(target) or (os.path.isdir(target) and _dir_refused(target)):
                        return target, False
                    if os.path.isdir(target) and target not in seen:
                        entries.append(target)
            elif _owned_name(name) is not None:
                if os.path.isdir(full):
                    found = _walk_tree(full, walk) if deep else (
                        full if _dir_refused(full) else None)
                    if found is not None:
                        return found, False
                elif not os.access(full, os.R_OK):
                    return full, False
    return None, walk.cut
