/* Firecracker's guest in tests/bench/sessions: a static /init that answers each connection on
 * vsock port 52 from a process of its own ("ok\n", written by a forked child, as an exec's output
 * comes from a new process), so a host that connects through Firecracker's vsock socket times the
 * guest's first answer after a boot or a snapshot load. */
#include <linux/vm_sockets.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

int main(void) {
    struct sockaddr_vm a = {.svm_family = AF_VSOCK, .svm_port = 52, .svm_cid = VMADDR_CID_ANY};
    int s = socket(AF_VSOCK, SOCK_STREAM, 0);
    if (s < 0 || bind(s, (struct sockaddr *)&a, sizeof a) != 0 || listen(s, 16) != 0)
        reboot(RB_AUTOBOOT); /* no vsock: Firecracker exits, the bench says the peer failed */
    for (;;) {
        int c = accept(s, 0, 0);
        if (c < 0)
            continue;
        pid_t p = fork();
        if (p == 0) {
            (void)!write(c, "ok\n", 3);
            _exit(0);
        }
        close(c);
        if (p > 0)
            waitpid(p, 0, 0);
    }
}
