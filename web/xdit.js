// comfyui-xdit: a sidebar tab showing the xDiT worker pools (GET /xdit/status) with
// Unload / Restart buttons (POST /xdit/unload, /xdit/restart). Polls while visible.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const POLL_MS = 2000;

function esc(s) {
  return String(s ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
}

function pct(x) {
  return x != null ? Math.round(x * 100) + "%" : "";
}

function renderPool(p) {
  const state = p.state === "running" && p.total ? `running ${p.step ?? 0}/${p.total}` : p.state;
  // each rank's share of the work, its measured block time and its share of the weights
  // (GPUs of different speed or memory; the server merges them into the rank rows)
  const ranks = (p.ranks || []).map((r) =>
    `<tr><td>${esc(r.rank)}</td><td>${esc(r.pid)}</td><td>${esc(r.device ?? p.device)}</td>` +
    `<td>${r.rss_mb != null ? Math.round(r.rss_mb) + " MB" : ""}</td>` +
    `<td>${r.gpu_mem_mb != null ? Math.round(r.gpu_mem_mb) + " MB" : ""}</td>` +
    `<td>${esc(pct(r.share))}${r.weight_share != null ? ` (weights ${esc(pct(r.weight_share))})` : ""}</td>` +
    `<td>${r.step_s != null ? esc(Number(r.step_s).toFixed(2)) + " s" : ""}</td>` +
    `<td>${r.stage ? `${r.stage.index + 1}/${r.stage.of} (blocks ${r.stage.blocks[0]}–${r.stage.blocks[1] - 1})` : ""}</td></tr>`).join("");
  return `<div style="margin-bottom:10px;padding:6px;border:1px solid var(--border-color,#444);border-radius:4px">
    <div><b>${esc((p.model || "").split("/").pop())}</b> — ${esc(state)}</div>
    <div style="opacity:.8">${esc(p.config)} · ${esc(p.world_size)} rank(s) · ${esc(p.device)} ${esc(p.dtype)} · launches ${esc(p.launches)}</div>
    ${ranks ? `<table style="width:100%;font-size:12px"><tr><th>rank</th><th>pid</th><th>device</th><th>RSS</th><th>GPU</th><th title="share of the work (split ${esc(p.split_mode ?? "even")})">share</th><th title="the rank's own block time in the last job">step</th><th>stage</th></tr>${ranks}</table>` : ""}
    ${p.slow_rank ? `<div style="color:#eb4">${esc(p.slow_rank)}</div>` : ""}
    ${p.error ? `<div style="color:#e66">${esc(p.error)}</div>` : ""}
  </div>`;
}

async function refresh(el) {
  let body;
  try {
    const r = await api.fetchApi("/xdit/status");
    body = await r.json();
  } catch (e) {
    el.querySelector(".xdit-pools").innerHTML = `<div style="color:#e66">status unavailable: ${esc(e)}</div>`;
    return;
  }
  const pools = body.pools || [];
  el.querySelector(".xdit-pools").innerHTML = pools.length
    ? pools.map(renderPool).join("")
    : "<div style='opacity:.7'>No pool yet: it starts at the first xDiT sampling.</div>";
  const job = body.last_job || {};
  // the server clears last_error when a job starts: only the latest job's error shows
  el.querySelector(".xdit-last").innerHTML =
    (body.launching ? `<div>launching: ${esc(body.launching)}</div>` : "") +
    (body.last_error ? `<div style="color:#e66">last error: ${esc(body.last_error)}</div>` : "") +
    (body.last_error_log ? `<div style="opacity:.8">full log: <code style="user-select:all">${esc(body.last_error_log)}</code></div>` : "") +
    (job.config ? `<div style="opacity:.8">last job: ${esc(job.config)}, ${esc(job.width)}x${esc(job.height)} x${esc(job.batch)}, ${esc(job.steps)} steps, ${esc(job.seconds)} s</div>` : "");
}

async function post(path, el) {
  try {
    await api.fetchApi(path, { method: "POST" });
  } finally {
    refresh(el);
  }
}

const EXTENSION = "xDiT.StatusPanel";

// The pack installed twice (two folders in custom_nodes/) loads this script twice; the
// frontend refuses a second extension of the same name with a console error, so the second
// copy registers nothing and the one panel stays.
if (!(app.extensions || []).some((e) => e.name === EXTENSION)) app.registerExtension({
  name: EXTENSION,
  async setup() {
    const tab = {
      id: "xdit-status",
      icon: "pi pi-server",
      title: "xDiT",
      tooltip: "xDiT worker pool",
      type: "custom",
      render: (el) => {
        el.innerHTML = `<div style="padding:8px;font-size:13px">
          <h3 style="margin:0 0 8px">xDiT pool</h3>
          <div class="xdit-pools"></div><div class="xdit-last"></div>
          <div style="margin-top:8px;display:flex;gap:6px">
            <button class="xdit-restart" title="Stop the workers; the next sampling relaunches them">Restart</button>
            <button class="xdit-unload" title="Stop the workers and forget the pool (frees memory)">Unload</button>
          </div></div>`;
        el.querySelector(".xdit-unload").onclick = () => post("/xdit/unload", el);
        el.querySelector(".xdit-restart").onclick = () => post("/xdit/restart", el);
        refresh(el);
        clearInterval(el._xditTimer);
        el._xditTimer = setInterval(() => {
          if (!el.isConnected) return clearInterval(el._xditTimer);
          refresh(el);
        }, POLL_MS);
      },
    };
    if (app.extensionManager?.registerSidebarTab) {
      app.extensionManager.registerSidebarTab(tab);
    }
    // refresh promptly when a job starts (its error is gone), on progress and on failure
    for (const ev of ["execution_start", "progress", "execution_error"]) {
      api.addEventListener(ev, () => {
        const el = document.querySelector(".xdit-pools")?.parentElement?.parentElement;
        if (el) refresh(el);
      });
    }
  },
});
