#!/usr/bin/env bash
# shellcheck disable=SC2016 # the single-quoted commands are expanded by the shell inside
# Checks tests/kvm-host/run end to end: streams kept apart, exit statuses, a real KVM guest, cwd/env, 5 MB byte-exact,
# SIGTERM clean-up, and timings. Prints one line per check; exits 1 if any failed. ~1 min on a warm cache.
set -u -o pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
run=$here/run
tmp=$(mktemp -d /tmp/kvm-host-selftest.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fails=0
check() { # name, condition result (0 = ok), detail
	if [[ $2 == 0 ]]; then printf 'ok    %s %s\n' "$1" "$3"; else printf 'FAIL  %s %s\n' "$1" "$3"; fails=$((fails + 1)); fi
}
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
leftovers() { pgrep -f 'name amvm-kvm-host|virtiofsd --socket-path=/tmp/amvm-kvmhost' >/dev/null && echo yes || echo no; }

"$run" -- true || { echo "FAIL  warm-up run (set-up?)"; exit 1; }

"$run" -- sh -c 'echo out; echo err >&2; exit 7' >"$tmp/o" 2>"$tmp/e"
rc=$?
[[ $rc == 7 && $(cat "$tmp/o") == out && $(cat "$tmp/e") == err ]]
check streams $? "(rc=$rc stdout=$(tr '\n' '|' <"$tmp/o") stderr=$(tr '\n' '|' <"$tmp/e"))"

for c in 'exit 0:0' 'exit 1:1' 'exit 255:255' 'kill -9 $$:137'; do
	"$run" -- sh -c "${c%:*}"
	rc=$?
	[[ $rc == "${c##*:}" ]]
	check "status '${c%:*}'" $? "-> $rc"
done

out=$("$run" -- "$here/kvm-smoke.py" 2>&1)
check "kvm guest runs" $? "($(echo "$out" | tr '\n' ' '))"
out=$("$run" -- sh -c 'dmesg | grep -c "Nested Paging enabled"')
[[ $out -ge 1 ]]
check "kvm_amd with NPT" $? ""

out=$(cd "$here" && FOO=bar "$run" -- sh -c 'echo "$PWD $FOO"')
[[ $out == "$here bar" ]]
check "cwd + env" $? "($out)"

"$run" -- sh -c 'head -c 5000000 /dev/urandom | base64 >/tmp/x; sha256sum </tmp/x >&2; cat /tmp/x' >"$tmp/big" 2>"$tmp/sum"
inside=$(cut -d' ' -f1 "$tmp/sum") outside=$(sha256sum <"$tmp/big" | cut -d' ' -f1)
[[ -n $inside && $inside == "$outside" ]]
check "5 MB byte-exact" $? "($(wc -c <"$tmp/big") bytes)"

t0=$(now)
"$run" -- sh -c 'echo started; sleep 100' >"$tmp/sig" &
pid=$!
until [[ -s $tmp/sig ]]; do sleep 0.05; done
t1=$(now)
kill -TERM "$pid"
wait "$pid"
rc=$?
sleep 0.3
[[ $rc == 143 && $(leftovers) == no ]] && ! compgen -G '/tmp/amvm-kvmhost.*' >/dev/null
check "SIGTERM clean-up" $? "(rc=$rc)"

t2=$(now)
"$run" -- true
t3=$(now)
[[ $(leftovers) == no ]] && ! compgen -G '/tmp/amvm-kvmhost.*' >/dev/null
check "no leftovers" $? ""
echo "time to command running: $(secs "$t0" "$t1") s; total for true: $(secs "$t2" "$t3") s"
exit $((fails > 0))
