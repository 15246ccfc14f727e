/* The one program of the real nodes' local image, linked statically so the image holds
 * nothing else (no registry is reachable, so even the pod sandbox image is built here).
 *
 *   pause        a pod's sandbox: sleeps until SIGTERM or SIGINT and reaps any child
 *                (it is PID 1 of a pod that shares its process namespace)
 *   pause id     prints "uid=<uid> gid=<gid>" and exits 0
 *   pause echo   prints its other arguments, one line, and exits 0
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static volatile sig_atomic_t stop;

static void on_stop(int sig) { (void)sig; stop = 1; }

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

static int pause_until_stopped(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sa.sa_handler = on_child;
    sa.sa_flags = SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    while (!stop) {
        pause();
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        return pause_until_stopped();
    }
    if (strcmp(argv[1], "id") == 0) {
        printf("uid=%u gid=%u\n", (unsigned)getuid(), (unsigned)getgid());
        return 0;
    }
    if (strcmp(argv[1], "echo") == 0) {
        for (int i = 2; i < argc; i++) {
            printf(i + 1 < argc ? "%s " : "%s", argv[i]);
        }
        printf("\n");
        return 0;
    }
    fprintf(stderr, "usage: %s [id | echo WORDS...]\n", argv[0]);
    return 2;
}
