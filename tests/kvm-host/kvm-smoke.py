#!/usr/bin/env python3
"""Proves /dev/kvm is a working KVM: runs 5 bytes of real-mode guest code (out 0x10, 0x42; hlt) in a fresh VM.

Used by selftest.sh through ./run; prints the API version and the two exits and exits 0 on success.
"""
import ctypes
import fcntl
import mmap
import os
import struct
import sys

KVM_GET_API_VERSION, KVM_CREATE_VM, KVM_GET_VCPU_MMAP_SIZE = 0xAE00, 0xAE01, 0xAE04
KVM_SET_USER_MEMORY_REGION, KVM_CREATE_VCPU, KVM_RUN = 0x4020AE46, 0xAE41, 0xAE80
KVM_GET_SREGS, KVM_SET_SREGS, KVM_SET_REGS = 0x8138AE83, 0x4138AE84, 0x4090AE82
KVM_EXIT_IO, KVM_EXIT_HLT = 2, 5

kvm = os.open("/dev/kvm", os.O_RDWR)
print("KVM_GET_API_VERSION", fcntl.ioctl(kvm, KVM_GET_API_VERSION))
vm = fcntl.ioctl(kvm, KVM_CREATE_VM, 0)
mem = mmap.mmap(-1, 0x10000)
mem[0x1000:0x1005] = bytes([0xB0, 0x42, 0xE6, 0x10, 0xF4])  # mov al,0x42; out 0x10,al; hlt
addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
fcntl.ioctl(vm, KVM_SET_USER_MEMORY_REGION, struct.pack("IIQQQ", 0, 0, 0, 0x10000, addr))
vcpu = fcntl.ioctl(vm, KVM_CREATE_VCPU, 0)
run = mmap.mmap(vcpu, fcntl.ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
sregs = bytearray(312)
fcntl.ioctl(vcpu, KVM_GET_SREGS, sregs)
struct.pack_into("Q", sregs, 0, 0)  # cs.base
struct.pack_into("H", sregs, 12, 0)  # cs.selector
fcntl.ioctl(vcpu, KVM_SET_SREGS, bytes(sregs))
regs = [0] * 18
regs[16], regs[17] = 0x1000, 2  # rip, rflags
fcntl.ioctl(vcpu, KVM_SET_REGS, struct.pack("18Q", *regs))
seen = []
for _ in range(2):
    fcntl.ioctl(vcpu, KVM_RUN, 0)
    reason = struct.unpack_from("I", run, 8)[0]
    if reason == KVM_EXIT_IO:
        _, _, port, _, off = struct.unpack_from("BBHIQ", run, 32)
        seen.append(("io", port, run[off]))
    else:
        seen.append(("exit", reason))
print("exits", seen)
sys.exit(0 if seen == [("io", 0x10, 0x42), ("exit", KVM_EXIT_HLT)] else 1)
