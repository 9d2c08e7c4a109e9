// Small async helpers shared by the conformance tests.

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

// Polls `predicate` (sync or async) every `interval` ms until it returns a
// truthy value, which is then returned. Rejects after `timeoutMs`. If the
// predicate throws, the error is propagated at once (so a recorded client
// error fails the test immediately instead of after a timeout).
export async function waitFor(predicate, timeoutMs = 10000, { interval = 20, message } = {}) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const value = await predicate()
    if (value) return value
    if (Date.now() >= deadline) {
      const what = typeof message === 'function' ? message() : message
      throw new Error(`waitFor: timed out after ${timeoutMs} ms` + (what ? `: ${what}` : ''))
    }
    await sleep(Math.min(interval, Math.max(1, deadline - Date.now())))
  }
}

// Races `promise` against a timer; rejects with `message` on timeout.
export async function withTimeout(promise, ms, message) {
  let timer
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${message}`)), ms)
  })
  try {
    return await Promise.race([promise, timeout])
  } finally {
    clearTimeout(timer)
  }
}

// "v3" -> v3 (only for strong ETags; weak ones keep their W/ prefix so that a
// test comparing them with versions fails visibly).
export function etagToVersion(etag) {
  if (etag == null) return null
  const m = /^"(.*)"$/.exec(etag)
  return m ? m[1] : etag
}

export function truncate(s, n = 200) {
  s = String(s)
  return s.length > n ? s.slice(0, n) + `... (${s.length} chars)` : s
}
