/* api.c: version and status names. */
#include "specfast.h"

SF_API unsigned sf_version(void) { return SF_VERSION_NUMBER; }

SF_API const char *sf_status_string(sf_status status) {
    switch (status) {
    case SF_OK: return "ok";
    case SF_ERR_ARGUMENT: return "invalid argument";
    case SF_ERR_SHAPE: return "inconsistent shapes or counts";
    case SF_ERR_PARAM: return "sampling parameter out of range";
    case SF_ERR_LOGITS: return "NaN or +inf logit";
    case SF_ERR_ALL_MASKED: return "row with every logit -inf";
    case SF_ERR_TOKEN: return "draft token out of range";
    case SF_ERR_PARENT: return "invalid parent index";
    case SF_ERR_DRAFT_PROBS: return "malformed draft probabilities";
    case SF_ERR_NO_MEMORY: return "out of memory";
    case SF_ERR_THREADS: return "thread pool failed to start";
    case SF_ERR_UNSUPPORTED: return "not supported by this build";
    }
    return "unknown status";
}
