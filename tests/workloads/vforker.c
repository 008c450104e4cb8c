/* A parent held in the kernel (state D, wait_for_vfork_done) while its vfork child sleeps:
 * a task whose SIGSTOP takes effect only once the child has exec'd or exited. */
#include <stdio.h>
#include <unistd.h>

int main(void) {
    printf("up\n");
    fflush(stdout);
    if (vfork() == 0) {
        sleep(60);
        _exit(0);
    }
    return 0;
}
