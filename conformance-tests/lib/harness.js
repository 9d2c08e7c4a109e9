// Per-file fixture: one origin and one proxy, started before the file's
// tests and stopped (SIGTERM, then SIGKILL) after them, even on failure.

import { before, after } from 'node:test'
import { startOrigin } from './origin.js'
import { startProxy } from './proxy.js'

/**
 * opts: {seed(origin), pollInterval, heartbeat, args}
 * Returns an object whose `origin` and `proxy` are set once before() ran.
 */
export function useProxy(opts = {}) {
  const ctx = { origin: null, proxy: null }
  before(async () => {
    ctx.origin = await startOrigin()
    if (opts.seed) await opts.seed(ctx.origin)
    ctx.proxy = await startProxy({ upstream: ctx.origin.url, ...opts })
  })
  after(async () => {
    const crashed = ctx.proxy?.exited
    const stopped = await ctx.proxy?.stop()
    await ctx.origin?.close()
    if (crashed)
      throw new Error(
        `braid-proxy exited during the tests (code ${crashed.code}, signal ${crashed.signal})\n--- output ---\n${ctx.proxy.output()}`,
      )
    if (stopped?.forced) throw new Error('braid-proxy did not exit within 5 s of SIGTERM (it was killed)')
  })
  return ctx
}

/** Runs fn(list) and closes every subscription pushed onto `list`, even on failure. */
export async function withSubs(fn) {
  const list = []
  try {
    return await fn(list)
  } finally {
    for (const s of list) s.close()
  }
}
