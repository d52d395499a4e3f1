/* The peer's guest userland for the boot benchmark: a static /init that reboots at once. */
#include <sys/reboot.h>
#include <unistd.h>

int main(void) {
    reboot(RB_AUTOBOOT);
    for (;;)
        pause();
}
