#!/bin/sh
# Installs the prose corpus of `dataset=pydocs`: the Python manuals (tutorial, how-tos, library
# and language reference, what's new; about 11 MB of English reStructuredText) from Debian's
# python3-doc package, under /usr/share/doc/python3.*/html/_sources. Safe to run again: an
# installed package is left as it is. Needs root (or sudo) and a Debian/Ubuntu package source.
set -eu

if ls -d /usr/share/doc/python3*/html/_sources >/dev/null 2>&1; then
    echo "prose corpus already installed: $(ls -d /usr/share/doc/python3*/html/_sources | tail -n 1)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_prose_corpus.sh: apt-get not found; install your system's Python documentation" \
         "package, or point dataset.path= at a folder of the manuals' .rst.txt sources" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
# a fresh container has no package lists yet
if ! apt-cache show python3-doc >/dev/null 2>&1; then
    $SUDO apt-get update
fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends python3-doc
if ! ls -d /usr/share/doc/python3*/html/_sources >/dev/null 2>&1; then
    # slim container images tell dpkg to drop /usr/share/doc (a path-exclude line)
    echo "install_prose_corpus.sh: python3-doc is installed but its files are not; remove the" \
         "path-exclude of /usr/share/doc in /etc/dpkg/dpkg.cfg.d/ and reinstall it with" \
         "apt-get install --reinstall python3-doc" >&2
    exit 1
fi
echo "prose corpus installed: $(ls -d /usr/share/doc/python3*/html/_sources | tail -n 1)"
