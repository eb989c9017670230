/* A tiny static test program for the node's fail-fast checks (see probe.rs).
 *   probe info            uid, gid, seccomp and no_new_privs, memory cgroup and limit
 *   probe info-and-wait   the same, then waits for a signal (a Pod that stays up)
 *   probe alloc MB        allocates and touches MB MiB (exceeds a memory limit on purpose)
 *   probe connect IP PORT sends a plain HTTP request, prints the answer's first line */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static void print_matching(const char *path, const char *a, const char *b) {
    char line[512];
    FILE *f = fopen(path, "r");
    if (!f) { printf("%s: unreadable\n", path); return; }
    while (fgets(line, sizeof line, f))
        if (strstr(line, a) || (b && strstr(line, b))) fputs(line, stdout);
    fclose(f);
}

static void info(void) {
    printf("uid=%d gid=%d\n", (int)getuid(), (int)getgid());
    print_matching("/proc/self/status", "Seccomp:", "NoNewPrivs:");
    print_matching("/proc/self/cgroup", ":memory:", NULL);
    printf("memory.limit_in_bytes: ");
    print_matching("/sys/fs/cgroup/memory/memory.limit_in_bytes", "", NULL);
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "info") == 0) { info(); return 0; }
    if (argc > 1 && strcmp(argv[1], "info-and-wait") == 0) {
        info();
        for (;;) pause();
    }
    if (argc > 2 && strcmp(argv[1], "alloc") == 0) {
        long mb = atol(argv[2]);
        for (long i = 0; i < mb; i++) {
            char *p = malloc(1 << 20);
            if (!p) { printf("malloc failed at %ld MiB\n", i); return 1; }
            memset(p, 1, 1 << 20);
        }
        printf("allocated %ld MiB\n", mb);
        return 0;
    }
    if (argc > 3 && strcmp(argv[1], "connect") == 0) {
        struct sockaddr_in addr = {0};
        addr.sin_family = AF_INET;
        addr.sin_port = htons((unsigned short)atoi(argv[3]));
        if (inet_pton(AF_INET, argv[2], &addr.sin_addr) != 1) { printf("bad address\n"); return 2; }
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        struct timeval tv = {5, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
        if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) { perror("connect"); return 1; }
        const char *req = "GET /readyz HTTP/1.0\r\nHost: kubernetes\r\n\r\n";
        if (write(fd, req, strlen(req)) < 0) { perror("write"); return 1; }
        char buf[256] = {0};
        ssize_t n = read(fd, buf, sizeof buf - 1);
        if (n <= 0) { perror("read"); return 1; }
        char *eol = strpbrk(buf, "\r\n");
        if (eol) *eol = 0;
        printf("connected to %s:%s, answer: %s\n", argv[2], argv[3], buf);
        return 0;
    }
    fprintf(stderr, "usage: probe info|info-and-wait|alloc MB|connect IP PORT\n");
    return 2;
}
