#!/usr/bin/env bash
# System packages the studio and its tests need, installed only when missing (Debian).
# sshd, avahi and dbus for the emulated testbed; Xvfb and Qt's xcb libraries for a real window;
# fortunes: the English text the demo model is trained on (core/models/training.py).
set -euo pipefail
pkgs=(openssh-server openssh-client iproute2 avahi-daemon avahi-utils dbus xvfb xauth fortunes
      libxcb-icccm4 libxcb-keysyms1 libxcb-cursor0 libxcb-image0 libxcb-render-util0
      libxcb-shape0 libxcb-randr0 libxcb-xinerama0 libxkbcommon-x11-0 libegl1 libgl1 libfontconfig1 libdbus-1-3)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing system packages: ${missing[*]} (run as root or: sudo apt-get install ${missing[*]})" >&2
    exit 1
  fi
  echo "installing system packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
