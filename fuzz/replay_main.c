/*
 * replay_main.c: runs fuzz_api.c's LLVMFuzzerTestOneInput on files, without
 * libFuzzer, so any C compiler can replay the corpus against any build of the
 * library (tests/test_fuzz_regressions.py does, against the installed one).
 *
 *   cc -O1 -Icsrc/include fuzz/fuzz_api.c fuzz/replay_main.c -lspecfast -lm
 *   ./a.out FILE_OR_DIR...
 *
 * Prints one line per input; a broken invariant aborts with its message.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int run_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); return 1; }
    uint8_t *buf = NULL;
    size_t n = 0, cap = 0;
    for (;;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 4096;
            uint8_t *p = realloc(buf, cap);
            if (!p) { fclose(f); free(buf); return 1; }
            buf = p;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0) break;
    }
    fclose(f);
    printf("replay %s (%zu bytes)\n", path, n);
    fflush(stdout);
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 0;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    int bad = 0, count = 0;
    for (int i = 1; i < argc; i++) {
        struct stat st;
        if (stat(argv[i], &st) != 0) { perror(argv[i]); return 1; }
        if (!S_ISDIR(st.st_mode)) { bad |= run_file(argv[i]); count++; continue; }
        DIR *d = opendir(argv[i]);
        if (!d) { perror(argv[i]); return 1; }
        char **names = NULL;
        size_t nn = 0;
        for (struct dirent *e; (e = readdir(d));) {
            if (e->d_name[0] == '.') continue;
            char **p = realloc(names, (nn + 1) * sizeof *names);
            if (!p) return 1;
            names = p;
            size_t len = strlen(argv[i]) + strlen(e->d_name) + 2;
            names[nn] = malloc(len);
            snprintf(names[nn], len, "%s/%s", argv[i], e->d_name);
            nn++;
        }
        closedir(d);
        qsort(names, nn, sizeof *names, cmp_str);
        for (size_t k = 0; k < nn; k++) {
            bad |= run_file(names[k]);
            count++;
            free(names[k]);
        }
        free(names);
    }
    printf("replayed %d inputs\n", count);
    return bad;
}
