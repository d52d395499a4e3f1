# shellcheck shell=bash
# shellcheck disable=SC2034 # the KH_* results are read by run
# Set-up of the emulated KVM host, sourced by tests/kvm-host/run.
#
# Everything lands in $KH_CACHE (default ~/.cache/amvm/kvm-host) and is reused: a warm machine only checks that the
# pieces exist. kh_setup runs under an exclusive flock on $KH_CACHE/lock, so concurrent runners wait for one set-up
# instead of racing. On success it sets KH_VMLINUZ, KH_INITRD and KH_VIRTIOFSD.
#
# Cache layout:
#   lock                      flock(1) file
#   setup.log                 output of the last apt-get / cargo / depmod steps
#   kernel/current            "<package> <kernel release>" chosen at first set-up
#   kernel/<package>/         the .deb and its dpkg -x tree (boot/vmlinuz-*, lib/modules/<release>/ + modules.dep)
#   (virtiofsd: images/install-virtiofsd, shared with amvm, in $AMVM_CACHE/virtiofsd)
#   initramfs/<key>.cpio      newc cpio; key = sha256 of init script, this file, kernel release, busybox

KH_PACKAGES=(qemu-system-x86 busybox-static libseccomp-dev libcap-ng-dev kmod cpio)
KH_VIRTIOFSD_VERSION=1.14.0
# Modules the emulated host needs, in load order; modprobe --show-depends adds whatever they depend on.
KH_MODULES=(virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci fuse virtiofs virtio_console
	overlay irqbypass kvm kvm_amd)

kh_step() { printf 'kvm-host: %s\n' "$*" >&2; }

# Runs a set-up command; its output goes to setup.log (and to stderr when verbose).
kh_logged() {
	if [[ ${AMVM_KVMHOST_VERBOSE:-0} == 1 ]]; then
		"$@" 2>&1 | tee -a "$KH_CACHE/setup.log" >&2
		return "${PIPESTATUS[0]}"
	fi
	"$@" >>"$KH_CACHE/setup.log" 2>&1
}

kh_fail_setup() {
	printf 'kvm-host: set-up failed: %s (log: %s)\n' "$*" "$KH_CACHE/setup.log" >&2
	exit 125
}

kh_setup_packages() {
	local missing=() p status
	for p in "${KH_PACKAGES[@]}"; do
		status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null) || status=
		[[ $status == installed ]] || missing+=("$p")
	done
	((${#missing[@]})) || return 0
	[[ $(id -u) == 0 ]] || kh_fail_setup "packages missing (${missing[*]}); install them as root"
	kh_step "apt-get install ${missing[*]}"
	kh_logged apt-get update -q || kh_fail_setup "apt-get update"
	DEBIAN_FRONTEND=noninteractive kh_logged apt-get install -y -q --no-install-recommends "${missing[@]}" ||
		kh_fail_setup "apt-get install ${missing[*]}"
}

# Debian's 6.1 cloud kernel: the package linux-image-cloud-amd64 depends on, unpacked with dpkg -x.
kh_setup_kernel() {
	local dir=$KH_CACHE/kernel pkg rel tree
	mkdir -p "$dir"
	if [[ ! -s $dir/current ]]; then
		pkg=$(kh_cloud_kernel_package)
		if [[ -z $pkg && $(id -u) == 0 ]]; then
			kh_logged apt-get update -q
			pkg=$(kh_cloud_kernel_package)
		fi
		[[ -n $pkg ]] || kh_fail_setup "cannot resolve the package behind linux-image-cloud-amd64 (apt-get update?)"
		echo "$pkg ${pkg#linux-image-}" >"$dir/current"
	fi
	read -r pkg rel <"$dir/current"
	tree=$dir/$pkg
	if [[ ! -e $tree/.complete ]]; then
		kh_step "fetching kernel $pkg"
		rm -rf "$tree" && mkdir -p "$tree"
		(cd "$tree" && kh_logged apt-get download -q "$pkg") || kh_fail_setup "apt-get download $pkg"
		kh_logged dpkg -x "$tree"/"$pkg"_*.deb "$tree/root" || kh_fail_setup "dpkg -x $pkg"
		# Debian ships no modules.dep (postinst runs depmod); make one for this tree.
		local moddir
		moddir=$(kh_moddir "$tree/root" "$rel") || kh_fail_setup "no modules directory for $rel"
		kh_logged depmod -b "${moddir%/lib/modules/"$rel"}" "$rel" || kh_fail_setup "depmod"
		rm -f "$tree"/"$pkg"_*.deb
		touch "$tree/.complete"
	fi
	KH_KREL=$rel
	KH_KTREE=$tree/root
	KH_VMLINUZ=$tree/root/boot/vmlinuz-$rel
	[[ -f $KH_VMLINUZ ]] || kh_fail_setup "no $KH_VMLINUZ"
}

kh_cloud_kernel_package() {
	apt-cache depends linux-image-cloud-amd64 2>/dev/null |
		sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -n1
}

kh_moddir() {
	local d
	for d in "$1/lib/modules/$2" "$1/usr/lib/modules/$2"; do
		[[ -d $d ]] && { echo "$d"; return 0; }
	done
	return 1
}

kh_setup_virtiofsd() {
	local here=$1
	KH_VIRTIOFSD=$("$here/../../images/install-virtiofsd") || kh_fail_setup "images/install-virtiofsd"
	[[ $("$KH_VIRTIOFSD" --version 2>/dev/null) == "virtiofsd $KH_VIRTIOFSD_VERSION" ]] ||
		kh_fail_setup "$KH_VIRTIOFSD is not virtiofsd $KH_VIRTIOFSD_VERSION"
}

# The emulated host's initramfs: static busybox, the init script, the modules (uncompressed) and their load order.
kh_setup_initramfs() {
	local here=$1 busybox=/bin/busybox key out
	[[ -x $busybox ]] || busybox=/usr/bin/busybox
	key=$( {
		cat "$here/init" "$here/setup.sh"
		echo "$KH_KREL ${KH_MODULES[*]}"
		stat -L -c '%s %Y' "$busybox"
	} | sha256sum | cut -c1-16)
	out=$KH_CACHE/initramfs/$key.cpio
	KH_INITRD=$out
	[[ -s $out ]] && return 0

	kh_step "building initramfs $key"
	local stage moddir line ko name seen=' '
	stage=$(mktemp -d "$KH_CACHE/initramfs.stage.XXXXXX")
	mkdir -p "$stage"/{bin,dev,proc,sys,host,lib/modules}
	cp "$busybox" "$stage/bin/busybox"
	cp "$here/init" "$stage/init"
	chmod 755 "$stage/init" "$stage/bin/busybox"
	moddir=$(kh_moddir "$KH_KTREE" "$KH_KREL") || kh_fail_setup "no modules directory"
	for name in "${KH_MODULES[@]}"; do
		while read -r line; do
			[[ $line == insmod\ * ]] || continue
			ko=${line#insmod }
			ko=${ko%% *}
			[[ $seen == *" $ko "* ]] && continue
			seen+="$ko "
			local base=${ko##*/}
			case $base in
			*.ko) cp "$ko" "$stage/lib/modules/$base" ;;
			*.ko.xz) base=${base%.xz} && xz -dc "$ko" >"$stage/lib/modules/$base" ;;
			*.ko.zst) base=${base%.zst} && zstd -qdc "$ko" >"$stage/lib/modules/$base" ;;
			*.ko.gz) base=${base%.gz} && gzip -dc "$ko" >"$stage/lib/modules/$base" ;;
			*) kh_fail_setup "unknown module format $ko" ;;
			esac || kh_fail_setup "copying $ko"
			echo "$base" >>"$stage/lib/modules/order"
		done < <(modprobe -d "${moddir%/lib/modules/"$KH_KREL"}" -S "$KH_KREL" --show-depends "$name" 2>>"$KH_CACHE/setup.log")
		[[ $seen == *"/${name}.ko"* || $seen == *"/${name//_/-}.ko"* ]] || kh_fail_setup "module $name not found"
	done
	mkdir -p "$KH_CACHE/initramfs"
	(cd "$stage" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --owner=0:0 --quiet) >"$out.tmp" ||
		kh_fail_setup "cpio"
	mv "$out.tmp" "$out"
	rm -rf "$stage"
	# Images of other init versions (other checkouts) are cheap to rebuild; drop the stale ones.
	find "$KH_CACHE/initramfs" -name '*.cpio' ! -name "$key.cpio" -mtime +7 -delete 2>/dev/null
}

# Entry point: $1 = directory of the run script.
kh_setup() {
	mkdir -p "$KH_CACHE" || kh_fail_setup "cannot create $KH_CACHE"
	KH_CACHE=$(cd "$KH_CACHE" && pwd -P)
	local lockfd
	exec {lockfd}>"$KH_CACHE/lock"
	if ! flock -w 2 "$lockfd"; then
		kh_step "waiting for another runner's set-up"
		flock "$lockfd"
	fi
	kh_setup_packages
	command -v qemu-system-x86_64 >/dev/null || kh_fail_setup "qemu-system-x86_64 not available"
	kh_setup_kernel
	kh_setup_virtiofsd "$1"
	kh_setup_initramfs "$1"
	exec {lockfd}>&-
}
