/*
 * kernelcache's compiled launcher client: on a hit, what the script path of
 * kernelcache/nvcc/client.py does, without starting Python.
 *
 * The launcher's server builds it in the background into the cache directory
 * (kernelcache/nvcc/native.py) and bin/kernelcache runs it as
 *
 *     launcher-client-<hash>-<machine>-<system>-<libc>-<host> PYTHON SCRIPT NVCC ARGS...
 *
 * It asks the server through launcher.sock exactly as client.py does (the
 * same cache directory, checks and request), then:
 *   - hit:   writes nvcc's stdout and stderr as they were, exits with its status;
 *   - plain: execs nvcc (the path the server resolved) with ARGS;
 *   - no server listening: execs PYTHON -I -S SCRIPT NVCC ARGS..., the Python
 *     client, which starts a server for the next call;
 *   - anything else (a miss, KERNELCACHE_SERVER=0, KERNELCACHE_READONLY=1, a
 *     directory it is unsure of, a server that hung, died or answered
 *     something unexpected):
 *     execs PYTHON -c RUN_LAUNCHER NVCC ARGS... (kernelcache.nvcc.launcher, after a
 *     first compile through the server was tried, without the current directory on
 *     sys.path), which is correct without any server.
 * Every length in a reply is checked before it is used.
 * "launcher-client-... --protocol" prints the protocol: the server's self-test;
 * "--trusted DIR" exits 0 when DIR passes the trust rule (tests compare it
 * with kernelcache/_trust.py on the same trees).
 *
 * bin/kernelcache runs it through a descriptor (/proc/self/fd/9): the file
 * it opened and checked is the file that runs. Before it asks anything, the
 * client checks that the cache directory and every ancestor are trusted
 * (open_trusted_dir) and that it is that directory's client (runs_from);
 * otherwise it hands over to the in-process launcher, which says why and
 * compiles without the cache (issue 19).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* client.RUN_LAUNCHER: the launcher without the build directory first on sys.path (a
 * project's own kernelcache.py must not run instead, nor break it). */
#define RUN_LAUNCHER "import sys\nif sys.path and sys.path[0] == '': del sys.path[0]\nfrom kernelcache.nvcc import compiling\ncompiling.main(sys.argv[1:])\nfrom kernelcache.nvcc import launcher\nsys.exit(launcher.main(sys.argv[1:]))"
/* client.PROTOCOL: a test checks that both say the same. */
#ifndef KC_PROTOCOL
#define KC_PROTOCOL "kernelcache-launcher/2"
#endif
#define SOCKET_NAME "launcher.sock"
#define REPLY_TIMEOUT 120.0 /* client.REPLY_TIMEOUT */
/* Far above nvcc's stdout and stderr; a larger announced reply is malformed. */
#define REPLY_MAX ((uint64_t)1 << 30)

extern char **environ;

/* What to do when the server gives no hit and no "plain". */
enum fallback { NO_SERVER, LOCAL };

struct buf {
    char *data;
    size_t len, cap;
};

struct item {
    const char *data;
    size_t len;
};

static void die(const char *what) {
    fprintf(stderr, "kernelcache: %s: %s\n", what, strerror(errno));
    exit(127);
}

static int reserve(struct buf *b, size_t extra) {
    if (extra > SIZE_MAX / 4 - b->len)
        return -1;
    if (b->len + extra <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra)
        cap *= 2;
    char *data = realloc(b->data, cap);
    if (data == NULL)
        return -1;
    b->data = data;
    b->cap = cap;
    return 0;
}

static void put_be(unsigned char *out, uint64_t value, int bytes) {
    for (int i = bytes - 1; i >= 0; i--, value >>= 8)
        out[i] = (unsigned char)(value & 0xff);
}

static uint64_t get_be(const unsigned char *in, int bytes) {
    uint64_t value = 0;
    for (int i = 0; i < bytes; i++)
        value = (value << 8) | in[i];
    return value;
}

/* One item of a message (client.pack): a 4-byte length, then the bytes. */
static int add(struct buf *b, const char *data, size_t len) {
    if (len > UINT32_MAX || reserve(b, 4 + len) != 0)
        return -1;
    put_be((unsigned char *)b->data + b->len, len, 4);
    if (len)
        memcpy(b->data + b->len + 4, data, len);
    b->len += 4 + len;
    return 0;
}

static int add_str(struct buf *b, const char *text) {
    return add(b, text, strlen(text));
}

static char *concat(const char *a, size_t alen, const char *b) {
    size_t blen = strlen(b);
    if (alen > SIZE_MAX - blen - 1)
        return NULL;
    char *out = malloc(alen + blen + 1);
    if (out == NULL)
        return NULL;
    memcpy(out, a, alen);
    memcpy(out + alen, b, blen + 1);
    return out;
}

static size_t rstrip_slashes(const char *text) {
    size_t n = strlen(text);
    while (n > 0 && text[n - 1] == '/')
        n--;
    return n;
}

static int is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* client.is_false, client.is_true: one of four words, any case, spaces around. */
static int is_word(const char *value, const char *const names[4]) {
    if (value == NULL)
        return 0;
    while (is_space(*value))
        value++;
    size_t n = strlen(value);
    while (n > 0 && is_space(value[n - 1]))
        n--;
    for (size_t i = 0; i < 4; i++)
        if (strlen(names[i]) == n && strncasecmp(value, names[i], n) == 0)
            return 1;
    return 0;
}

static const char *const FALSE_WORDS[4] = {"0", "false", "no", "off"};
static const char *const TRUE_WORDS[4] = {"1", "true", "yes", "on"};

/* client._timeout: KERNELCACHE_SERVER_TIMEOUT seconds, else the default. */
static double reply_timeout(void) {
    const char *text = getenv("KERNELCACHE_SERVER_TIMEOUT");
    if (text == NULL)
        return REPLY_TIMEOUT;
    char *end;
    errno = 0;
    double seconds = strtod(text, &end);
    while (is_space(*end))
        end++;
    if (end == text || *end || errno || !(seconds > 0))
        return REPLY_TIMEOUT;
    return seconds;
}

/* client.cache_dir: the directory Settings.load().dir gives; NULL if unsure. */
static char *cache_dir(const char *cwd) {
    const char *value = getenv("KERNELCACHE_DIR");
    const char *home = getenv("HOME");
    if (home == NULL)
        home = "";
    if (value == NULL) {
#if !defined(__linux__) || defined(__ANDROID__)
        return NULL;
#else
        if (getenv("ANDROID_DATA") != NULL)
            return NULL;
        const char *xdg = getenv("XDG_CACHE_HOME");
        if (xdg == NULL)
            xdg = "";
        if (xdg[0] == '/')
            return concat(xdg, rstrip_slashes(xdg), "/kernelcache");
        for (const char *p = xdg; *p; p++)
            if (!is_space(*p))
                return NULL; /* relative: platformdirs decides */
        if (home[0] != '/')
            return NULL;
        return concat(home, rstrip_slashes(home), "/.cache/kernelcache");
#endif
    }
    if (strcmp(value, "~") == 0 || strncmp(value, "~/", 2) == 0) {
        if (home[0] != '/')
            return NULL;
        return concat(home, rstrip_slashes(home), value + 1);
    }
    if (value[0] == '~' || value[0] == '\0')
        return NULL;
    if (value[0] == '/')
        return strdup(value);
    char *base = concat(cwd, rstrip_slashes(cwd), "/");
    char *dir = base ? concat(base, strlen(base), value) : NULL;
    free(base);
    return dir;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Wait for fd to be ready for events; 0 when it is, -1 past the deadline. */
static int wait_fd(int fd, short events, double deadline) {
    for (;;) {
        int ms = -1;
        if (isfinite(deadline)) {
            double left = deadline - now();
            if (left <= 0)
                return -1;
            ms = left * 1000 >= INT_MAX ? INT_MAX : (int)(left * 1000) + 1;
        }
        struct pollfd p = {.fd = fd, .events = events};
        int n = poll(&p, 1, ms);
        if (n > 0)
            return 0;
        if (n < 0 && errno != EINTR)
            return -1;
    }
}

/* The trust rule of kernelcache/_trust.py (one rule, two languages: a test
   runs both on the same trees). A directory is trusted when it and every
   ancestor belong to this user or root and nobody else can write them, save
   sticky ancestors (/tmp), where nobody renames what is not theirs; every
   link followed on the way must be this user's or root's too. The walk opens
   each component with O_NOFOLLOW relative to the one before and checks the
   directory it opened, so what it returns is what it checked. */
#define MAX_LINKS 40

static int owner_ok(const struct stat *st) {
    return st->st_uid == geteuid() || st->st_uid == 0;
}

static int ancestor_ok(const struct stat *st) {
    return S_ISDIR(st->st_mode) && owner_ok(st) &&
           (!(st->st_mode & 022) || (st->st_mode & S_ISVTX));
}

static int open_root(void) {
    int fd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    struct stat st;
    if (fd >= 0 && (fstat(fd, &st) != 0 || !ancestor_ok(&st))) {
        close(fd);
        return -1;
    }
    return fd;
}

/* A descriptor of the directory path once it is trusted, as this user's own
   (a program runs from it); -1 otherwise. */
static int open_trusted_dir(const char *path) {
    size_t cap = strlen(path) + 1;
    char *rest = malloc(cap);
    if (rest == NULL)
        return -1;
    memcpy(rest, path, cap);
    int fd = open_root(), links = 0;
    char *p = rest;
    while (fd >= 0) {
        while (*p == '/')
            p++;
        if (*p == '\0') {
            struct stat st;
            if (fstat(fd, &st) != 0 || !S_ISDIR(st.st_mode) || st.st_uid != geteuid() ||
                (st.st_mode & 022)) {
                close(fd);
                fd = -1;
            }
            break;
        }
        char *end = strchr(p, '/');
        char *next = end ? end + 1 : p + strlen(p);
        if (end)
            *end = '\0';
        if (strcmp(p, ".") == 0) {
            p = next;
            continue;
        }
        int child = openat(fd, p, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        struct stat st;
        if (child >= 0) {
            close(fd);
            fd = child;
            if (fstat(fd, &st) != 0 || !ancestor_ok(&st))
                break;
            p = next;
            continue;
        }
        char target[PATH_MAX];
        ssize_t n = -1;
        if ((errno == ELOOP || errno == ENOTDIR) && ++links <= MAX_LINKS &&
            fstatat(fd, p, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode) && owner_ok(&st))
            n = readlinkat(fd, p, target, sizeof target - 1);
        if (n <= 0)
            break;
        target[n] = '\0';
        /* the rest of the walk: the link's target, then what followed the link */
        size_t tail = strlen(next);
        char *joined = malloc((size_t)n + 1 + tail + 1);
        if (joined == NULL)
            break;
        memcpy(joined, target, (size_t)n);
        joined[n] = '/';
        memcpy(joined + n + 1, next, tail + 1);
        free(rest);
        rest = p = joined;
        if (target[0] == '/') {
            close(fd);
            fd = open_root();
        }
    }
    if (fd >= 0 && *p != '\0') { /* left the loop before the end: refused */
        close(fd);
        fd = -1;
    }
    free(rest);
    return fd;
}

/* Whether this process runs the client file of the checked directory: the
   front ran it through a descriptor (/proc/self/fd/9, which it then leaves
   open: closed here), so this is the file it checked, and the file must be
   the one of that name in the trusted directory. */
static int runs_from(int dirfd) {
    struct stat self, there, fd9;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0 || stat("/proc/self/exe", &self) != 0)
        return 0;
    exe[n] = '\0';
    const char *name = strrchr(exe, '/');
    if (fstat(9, &fd9) == 0 && fd9.st_dev == self.st_dev && fd9.st_ino == self.st_ino)
        close(9);
    return name != NULL && fstatat(dirfd, name + 1, &there, AT_SYMLINK_NOFOLLOW) == 0 &&
           S_ISREG(there.st_mode) && there.st_dev == self.st_dev && there.st_ino == self.st_ino &&
           there.st_uid == geteuid() && !(there.st_mode & 022);
}

/* A connection to this user's server in the checked directory dirfd: the fd,
   or -1 with *why set. */
static int connect_server(int dirfd, double deadline, enum fallback *why) {
    *why = NO_SERVER;
    struct stat st;
    if (fstatat(dirfd, SOCKET_NAME, &st, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISSOCK(st.st_mode) ||
        st.st_uid != getuid())
        return -1; /* none, not a socket, or not ours: never talk to it */
    /* Through the descriptor: the checked directory, and no sun_path limit. */
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    snprintf(addr.sun_path, sizeof addr.sun_path, "/proc/self/fd/%d/" SOCKET_NAME, dirfd);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        *why = LOCAL;
        return -1;
    }
    double left = deadline - now(); /* a full backlog blocks connect: bound it */
    if (left < 1e9) {
        if (left < 1e-3)
            left = 1e-3; /* 0 would mean "no limit" */
        struct timeval tv = {.tv_sec = (time_t)left};
        tv.tv_usec = (suseconds_t)((left - (double)tv.tv_sec) * 1e6);
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    }
    int rc;
    do
        rc = connect(fd, (struct sockaddr *)&addr, sizeof addr);
    while (rc != 0 && errno == EINTR);
    int err = errno;
    if (rc != 0) {
        close(fd);
        *why = err == ECONNREFUSED || err == ENOENT ? NO_SERVER : LOCAL;
        return -1;
    }
    *why = LOCAL;
#ifdef SO_PEERCRED
    struct ucred cred;
    socklen_t size = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &size) != 0 || size != sizeof cred ||
        cred.uid != getuid()) {
        close(fd);
        return -1;
    }
#else
    close(fd);
    return -1; /* no way to check who listens */
#endif
    if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The request client.ask sends: protocol, cwd, directory, umask, argv, environment. */
static int build_request(struct buf *b, const char *cwd, const char *dir, int argc, char **argv) {
    char number[32];
    if (reserve(b, 8) != 0)
        return -1;
    b->len = 8;
    mode_t mask = umask(022); /* read it (the only way), then put it back */
    umask(mask);
    if (add_str(b, KC_PROTOCOL) || add_str(b, cwd) || add_str(b, dir))
        return -1;
    snprintf(number, sizeof number, "%d", (int)mask);
    if (add_str(b, number))
        return -1;
    snprintf(number, sizeof number, "%d", argc);
    if (add_str(b, number))
        return -1;
    for (int i = 0; i < argc; i++)
        if (add_str(b, argv[i]))
            return -1;
    /* As Python's environ: entries without "=" left out, the first of a name wins. */
    for (char **e = environ; *e; e++) {
        const char *eq = strchr(*e, '=');
        if (eq == NULL)
            continue;
        size_t name = (size_t)(eq - *e) + 1;
        int seen = 0;
        for (char **f = environ; f < e && !seen; f++)
            seen = strncmp(*f, *e, name) == 0;
        if (!seen && add_str(b, *e))
            return -1;
    }
    put_be((unsigned char *)b->data, b->len - 8, 8);
    return 0;
}

static int send_all(int fd, const char *data, size_t len, double deadline) {
    while (len > 0) {
        if (wait_fd(fd, POLLOUT, deadline) != 0)
            return -1;
        ssize_t n = send(fd, data, len, MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return -1;
        }
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Exactly len bytes; -1 if the server hangs up or hangs before. */
static int recv_all(int fd, char *data, size_t len, double deadline) {
    while (len > 0) {
        if (wait_fd(fd, POLLIN, deadline) != 0)
            return -1;
        ssize_t n = recv(fd, data, len, 0);
        if (n == 0)
            return -1;
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK)
                continue;
            return -1;
        }
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* The items of a reply body (client.unpack): how many there are (-1 if
   malformed); the first `room` of them go to items. */
static long split(const char *body, size_t size, struct item *items, long room) {
    long count = 0;
    size_t i = 0;
    while (i < size) {
        if (size - i < 4)
            return -1;
        uint64_t n = get_be((const unsigned char *)body + i, 4);
        if (n > size - i - 4)
            return -1;
        if (count < room) {
            items[count].data = body + i + 4;
            items[count].len = (size_t)n;
        }
        count++;
        i += 4 + (size_t)n;
    }
    return count;
}

static int equals(struct item it, const char *text) {
    return it.len == strlen(text) && memcmp(it.data, text, it.len) == 0;
}

static int write_all(int fd, const char *data, size_t len) {
    while (len > 0) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                wait_fd(fd, POLLOUT, INFINITY);
                continue;
            }
            return -1;
        }
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* nvcc's status in a hit: "0".."255", nothing else. */
static int parse_status(struct item it) {
    if (it.len == 0 || it.len > 3)
        return -1;
    int status = 0;
    for (size_t i = 0; i < it.len; i++) {
        if (it.data[i] < '0' || it.data[i] > '9')
            return -1;
        status = status * 10 + (it.data[i] - '0');
    }
    return status <= 255 ? status : -1;
}

static void exec_nvcc(struct item path, char **args) {
    char *nvcc = malloc(path.len + 1);
    if (nvcc == NULL)
        die("out of memory");
    memcpy(nvcc, path.data, path.len);
    nvcc[path.len] = '\0';
    args[0] = nvcc; /* args[0] was the NVCC word of the command line */
    execv(nvcc, args);
    int err = errno;
    fprintf(stderr, "kernelcache: cannot run %s: [Errno %d] %s\n", nvcc, err, strerror(err));
    exit(127);
}

/* Ask the server; on a hit or "plain" this never returns. */
static enum fallback serve(int argc, char **argv) {
    double timeout = reply_timeout();
    double deadline = isfinite(timeout) ? now() + timeout : INFINITY;
    char *cwd = getcwd(NULL, 0);
    char *dir = cwd ? cache_dir(cwd) : NULL;
    if (dir == NULL)
        return LOCAL;
    /* A directory that is not trusted, or a client that is not its own: the
       in-process launcher says why and compiles without the cache. */
    int dirfd = open_trusted_dir(dir);
    if (dirfd < 0)
        return LOCAL;
    if (!runs_from(dirfd)) {
        close(dirfd);
        return LOCAL;
    }
    enum fallback why;
    int fd = connect_server(dirfd, deadline, &why);
    close(dirfd);
    if (fd < 0)
        return why;
    struct buf request = {0};
    unsigned char head[8];
    if (build_request(&request, cwd, dir, argc, argv) != 0 ||
        send_all(fd, request.data, request.len, deadline) != 0 ||
        recv_all(fd, (char *)head, 8, deadline) != 0) {
        close(fd);
        return LOCAL; /* a server that died or hung mid-request: compile without it */
    }
    free(request.data);
    uint64_t size = get_be(head, 8);
    char *body = size <= REPLY_MAX ? malloc(size ? (size_t)size : 1) : NULL;
    if (body == NULL || recv_all(fd, body, (size_t)size, deadline) != 0) {
        close(fd);
        return LOCAL;
    }
    close(fd);
    struct item items[4];
    long count = split(body, (size_t)size, items, 4);
    if (count == 4 && equals(items[0], "hit")) {
        int status = parse_status(items[1]);
        if (status < 0)
            return LOCAL;
        int ok = write_all(1, items[2].data, items[2].len) == 0;
        ok = write_all(2, items[3].data, items[3].len) == 0 && ok;
        exit(ok ? status : 1);
    }
    if (count == 2 && equals(items[0], "plain") && items[1].len > 0 &&
        memchr(items[1].data, '\0', items[1].len) == NULL)
        exec_nvcc(items[1], argv);
    if (count == 2 && equals(items[0], "fallback") && equals(items[1], "protocol"))
        return NO_SERVER; /* a server of another version: the Python client's turn */
    return LOCAL;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "--protocol") == 0) {
        puts(KC_PROTOCOL);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "--trusted") == 0) { /* for the test of the one rule */
        int fd = open_trusted_dir(argv[2]);
        return fd < 0 ? 1 : 0;
    }
    if (argc < 4) {
        fprintf(stderr, "usage: %s PYTHON SCRIPT NVCC ARGS...\n", argv[0]);
        return 2;
    }
    char *python = argv[1], *script = argv[2];
    char **nvcc_argv = argv + 3;
    int nvcc_argc = argc - 3;
    enum fallback why = LOCAL;
    /* Read-only writes nothing into the cache directory, and a server would. */
    if (!is_word(getenv("KERNELCACHE_SERVER"), FALSE_WORDS) &&
        !is_word(getenv("KERNELCACHE_READONLY"), TRUE_WORDS))
        why = serve(nvcc_argc, nvcc_argv);
    if (why == NO_SERVER) {
        char **cmd = malloc((size_t)(argc + 2) * sizeof *cmd);
        if (cmd == NULL)
            die("out of memory");
        cmd[0] = python;
        cmd[1] = "-I";
        cmd[2] = "-S";
        cmd[3] = script;
        memcpy(cmd + 4, nvcc_argv, (size_t)nvcc_argc * sizeof *cmd);
        cmd[4 + nvcc_argc] = NULL;
        execv(python, cmd);
    } else { /* argv[0..2] are free: the interpreter's command line, in place */
        argv[0] = python;
        argv[1] = "-c";
        argv[2] = RUN_LAUNCHER;
        execv(python, argv);
    }
    die(python);
    return 127;
}
