# shellcheck shell=bash
# Runs inside the emulated KVM host, as root, chrooted in the host's / (so this is the host's bash): restores the
# job's working directory and exact environment, then execs its argv. Files are NUL-separated, written by ./run.
dir=/run/kvm-host
IFS= read -r -d '' cwd <"$dir/cwd"
mapfile -d '' -t argv <"$dir/argv"
envs=()
while IFS= read -r -d '' e; do
	[[ $e == ?*=* ]] && envs+=("$e")
done <"$dir/environ"
cd -- "$cwd" || {
	echo "kvm-host: cannot enter $cwd in the emulated host (/run is an empty tmpfs there)" >&2
	exit 125
}
exec /usr/bin/env -i "${envs[@]}" "${argv[@]}"
