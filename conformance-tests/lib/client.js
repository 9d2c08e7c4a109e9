// A replica driven by the real braid-http 1.3.80 client.
//
// braid-http's update objects (verified against its source):
//   {version?: string[], parents?: string[], status?: "404" (a string, from
//    the update's status line), body?: Uint8Array, body_text (getter),
//    patches?: [{unit, range, content: Uint8Array, content_text (getter),
//                extra_headers?}], extra_headers?}
// An update carries either `body` (a snapshot) or `patches`.

import { fetch as braidFetch } from 'braid-http'
import { applyPatches } from './patch.js'
import { withTimeout, waitFor, truncate } from './util.js'

export { braidFetch }

/**
 * Subscribes to `url`. opts are passed to braid-http's fetch (parents,
 * heartbeats, retry, headers...). `initial` = {body, version} seeds the
 * replica when resuming with `parents`.
 */
export async function subscribe(url, opts = {}, { initial, headersTimeoutMs = 10000 } = {}) {
  const ac = new AbortController()
  const { signal: _ignored, ...rest } = opts
  const res = await withTimeout(
    braidFetch(url, { subscribe: true, signal: ac.signal, ...rest }),
    headersTimeoutMs,
    `no response headers for GET ${url} with Subscribe (they must be flushed at once)`,
  ).catch((e) => {
    ac.abort()
    throw e
  })

  const replica = {
    res,
    url,
    updates: [], // every update, as received
    errors: [], // errors reported by the client or by applying patches
    body: initial?.body != null ? Buffer.from(initial.body) : null, // Buffer
    version: initial?.version ?? null, // string[] | null
    status: null, // status of the last update ("404" after a delete), or null
    closed: false,

    get text() {
      return replica.body?.toString('utf8')
    },
    get versionId() {
      return replica.version ? replica.version.join(', ') : null
    },
    /** Throws the first recorded error, if any. */
    check() {
      if (replica.errors.length) {
        const e = replica.errors[0]
        throw e instanceof Error ? e : new Error(`subscription to ${url} failed: ${e}`)
      }
    },
    /** Waits until the replica is at version `v` (a version id string). */
    async waitForVersion(v, timeoutMs = 10000) {
      await waitFor(
        () => {
          replica.check()
          return replica.version?.length === 1 && replica.version[0] === v
        },
        timeoutMs,
        { message: () => `${url}: waiting for version ${v}, replica at ${JSON.stringify(replica.version)} after ${replica.updates.length} updates` },
      )
    },
    async waitForUpdates(n, timeoutMs = 10000) {
      await waitFor(
        () => {
          replica.check()
          return replica.updates.length >= n
        },
        timeoutMs,
        { message: () => `${url}: waiting for ${n} updates, got ${replica.updates.length}` },
      )
    },
    close() {
      replica.closed = true
      ac.abort()
    },
  }

  if (res.status !== 209) {
    ac.abort()
    throw new Error(`GET ${url} with Subscribe answered ${res.status}, expected 209`)
  }

  res.subscribe(
    (update) => {
      replica.updates.push(update)
      try {
        replica.status = update.status ?? null
        if (update.status && update.status !== '200') {
          // e.g. 404 after the origin deleted the resource: empty document
          replica.body = update.body ? Buffer.from(update.body) : Buffer.alloc(0)
        } else if (update.patches) {
          if (replica.body == null) throw new Error('got patches before any snapshot')
          if (update.parents && replica.version && update.parents.join('\n') !== replica.version.join('\n'))
            throw new Error(
              `update ${JSON.stringify(update.version)} has parents ${JSON.stringify(update.parents)} ` +
                `but the replica is at ${JSON.stringify(replica.version)}`,
            )
          replica.body = applyPatches(replica.body, update.patches)
        } else if (update.body) {
          replica.body = Buffer.from(update.body)
        } else {
          throw new Error(`update with neither body nor patches: ${truncate(JSON.stringify(update))}`)
        }
        if (update.version) replica.version = update.version
      } catch (e) {
        replica.errors.push(e)
      }
    },
    (err) => {
      if (!replica.closed) replica.errors.push(err)
    },
  )
  return replica
}

/** Is this braid-http update a snapshot (body, no patches)? */
export const isSnapshot = (u) => u.body != null && u.patches == null
